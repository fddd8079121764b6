"""Using a drafter: the OpenAI-compatible server and one-prompt generation."""
