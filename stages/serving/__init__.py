"""Serving a model over HTTP: the OpenAI API (chat and completions, streamed as server-sent
events) and a chat page, answered by one scheduler thread that batches greedy requests
(`python -m stages.serve`)."""
