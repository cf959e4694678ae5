"""Tasks built on the Lightning adapter: the task modules (classification, prompt classification, generation), their
data modules, metrics and the loading of pretrained models and tokenizers."""
