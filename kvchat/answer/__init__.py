"""Answering a question: the session that routes it to an episode, loads that cache, adds what recall or
retrieval brings (raw turns prefilled, or stored entries placed), decodes and rolls back, with receipts."""
