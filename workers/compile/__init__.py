"""``torch.compile`` of the model's forward (``--compile-model``): attention stays one opaque
op (``attention_op.py``), the rest is traced into one graph (``model.py``)."""
