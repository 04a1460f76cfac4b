"""The request every benchmark sends: a short single prompt on /generate, as SGLang clients post it."""

GENERATE_REQUEST = {
    "text": "The quick brown fox is a classic English pangram. Write one more sentence about the fox and the dog:",
    "sampling_params": {"max_new_tokens": 16, "temperature": 0.0},
}


def generate_request(stream: bool) -> dict:
    return {**GENERATE_REQUEST, "stream": True} if stream else dict(GENERATE_REQUEST)
