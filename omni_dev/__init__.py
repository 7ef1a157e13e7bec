"""Development tools that are not part of the omni_cli package: the tiny-model generators and their
tokenizer toolkit. Tests and scripts import them from a source checkout; `pip install` leaves them out."""
