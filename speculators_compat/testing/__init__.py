"""Test toolkit shipped with the package: tiny local models and the HF transformers reference."""
