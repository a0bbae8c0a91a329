"""model-surgeon: model surgery and multimodal assembly from checkpoints you already have."""

__version__ = "0.1.0"
