"""Vision parts for grafting an image encoder into a language model."""
