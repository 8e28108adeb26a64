"""maskcache: a small causal transformer whose attention mask is built once per length."""
