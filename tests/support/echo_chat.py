"""What the HTTP tests over the echo engine share: a question, the prompt the tiny model's chat
template makes of it (the echo engine streams its prompt back, so this is also the answer), and
the request extra that keeps a stream going to max_tokens."""

QUESTION = "What is the capital of Tuvalu?"
TEMPLATED = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    f"{QUESTION}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
)
IGNORE_EOS = {"nvext": {"ignore_eos": True}}
