"""`svip bench`: every length policy, the oracle and Hugging Face's assisted generation, side by
side on the same prompts, interleaved."""
