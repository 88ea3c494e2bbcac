"""Serving: `pyml serve`, the OpenAI API over a model folder (server), the grammars of structured
answers (constrained), tool calls (tools), log-probabilities (logprobs), and what running a
server for others needs (operations)."""
