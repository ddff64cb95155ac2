"""Triton kernels, each with a torch reference; a leaf package that imports nothing from Tidepool."""
