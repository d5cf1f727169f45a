"""``speculators-compat serve``: our engine behind speculators' own clients, where they expect
``vllm serve`` with its ``extract_hidden_states`` method and a hidden-states connector
(docs/serving.md). ``app.py``: the HTTP surface; ``service.py``: what a request becomes (token ids
checked, the prompt submitted to the engine's continuous loop, the file written); ``command.py``:
the command line."""
