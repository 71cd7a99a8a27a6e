"""One small declarative module per Hugging Face architecture, registered by ``model_type``."""
