"""`compactrl serve`: compactrl's engine behind the OpenAI API, one KV stream per session."""
