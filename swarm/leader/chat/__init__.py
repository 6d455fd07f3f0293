"""The conversation as text: chat templates to token ids and back, and what a reply's text holds as it streams
(reasoning, tool calls, gpt-oss's harmony channels, stop strings, log-probabilities)."""
