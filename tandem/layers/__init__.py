"""Layers of the model that own their weight format and kernel choice."""
