"""Training the tiny demo model: locally generated chat tasks, the tokenizer built from them."""
