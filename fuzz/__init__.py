"""Fuzz targets for the parsers that read untrusted bytes (see fuzz/README.md)."""
