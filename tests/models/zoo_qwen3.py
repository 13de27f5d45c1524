"""Zoo entry qwen3 (see hf_zoo.py)."""

from hf_zoo import model_file

globals().update(model_file("qwen3"))
