"""A chat history: read from any supported format into `Turn`s, tokenized with each turn's span, cut into
topical episodes; planted-fact histories for tests and evaluation."""
