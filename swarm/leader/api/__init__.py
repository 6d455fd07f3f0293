"""The leader's HTTP faces: OpenAI's Chat Completions and Responses, Anthropic's Messages, Ollama's API, the REST API
under /api/v1 with its admin, usage and spot-check routes, MCP, /metrics, and what guards them all (sign-in, limits,
security headers, one error shape)."""
