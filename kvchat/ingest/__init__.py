"""Building a conversation's memory: the plan (tokens, budgets, episodes, the memory check), the episode loop
that block-prefills and evicts, appends, layer profiles, and a batch on Ray workers."""
