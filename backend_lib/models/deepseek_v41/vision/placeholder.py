"""The prompt's mark for one image (the release tokenizer's id for it is ``image_token_id``, 129264; vLLM
``deepseek_v41/common/mm_preprocess.py -> IMAGE_PLACEHOLDER``). Torch-free: the OpenAI front writes it."""
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
