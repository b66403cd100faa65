"""Serving the model: sessions, continuous batching, lossless tree acceptance, worker devices and
the measured step-cost curve."""
