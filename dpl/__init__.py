"""dpl: differentially private fine-tuning of language models on Lightning."""

__version__ = "0.1.0"
