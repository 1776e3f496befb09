"""What both worker roles share: settings, the OpenAI endpoints over the async engine, registration."""
