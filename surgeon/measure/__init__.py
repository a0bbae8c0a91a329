"""Measuring a model against its parent: metrics.py (mean KL, top-1 agreement and perplexity on text
windows, with the parent's logits cached), instructions.py (prompts with checkable answers, greedy)
and compare.py (`surgeon eval`: checkpoints side by side)."""
