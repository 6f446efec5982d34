"""SDK v3's ``sagemaker.core.helper``."""
