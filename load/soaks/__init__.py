"""``load.soaks``: the gateway's API at scale: one large batch (`soak`), a million-row file (`file-soak`), the OpenAI flow (`openai-check`)."""
