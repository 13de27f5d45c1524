"""Zoo entry bart (see hf_zoo.py)."""

from hf_zoo import model_file

globals().update(model_file("bart"))
