"""The models kvchat runs: the causal LM (files, loading, the native forward, the decode step, weight formats,
device and dtype) and the sentence encoder."""
