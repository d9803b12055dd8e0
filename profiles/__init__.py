"""Calibrated per-model data that ships with kvchat: layer-sensitivity profiles (`kvchat profile-layers`).

This folder sits at the repository's top level and is mapped into the wheel as the package
`kvchat.profiles` (pyproject.toml), so `pip install` carries it. Files are looked up by the weights'
fingerprint they record, never by name.
"""
