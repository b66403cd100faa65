"""Generated code of the pardec.v1 proto package (see protos/generate.py)."""
