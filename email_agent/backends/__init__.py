"""Training/serving backends for the email agent."""
