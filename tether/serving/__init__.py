"""The engine behind OpenAI's HTTP API (`tether serve`): request schemas, the app, its metrics and the
process that runs it. Above `engine/`, which knows nothing of HTTP or chat templates."""
