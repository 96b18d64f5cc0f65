"""A pytok engine file whose generation fails after three tokens: a stream that breaks after it
began, for the Responses and Messages routes' failure events."""


async def generate(request):
    for token_id in request["token_ids"][:3]:
        yield {"token_ids": [token_id]}
    raise RuntimeError("the engine broke down")
