"""DeepSeek-V4.1's vision variant: the ViT (``tower``), the aligner into the text width (``aligner``), the image span
(``span``: roles and lengths), the encoder that loads ``vision.*`` / ``aligner.*`` / ``image_*`` and builds a span's
input embeddings (``encoder``), and the image preprocessing (``preprocess``: bytes -> patches). The design notes are
``../shared/design/DEEPSEEK_V41.md`` section 4."""
