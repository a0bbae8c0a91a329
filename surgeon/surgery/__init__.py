"""The weight math the operations and `surgeon analyze` share, free of recipes and reports:
architecture.py (shapes, layer names, rebuilding a model from a state dict), selection.py (glob
patterns over parameter names), layer_scores.py (which layers matter least), linear_bridge.py
(a fitted map over a dropped block), kv_heads.py and kv_merge.py (fewer KV heads, per group and per
model), attention_fit.py (a rewritten attention fitted to its parent's) and capture.py (forward hooks
as context managers, the one way anything here looks inside a forward pass)."""
