"""DeepSeek's Engram conditional memory (the demo layout), for the V3 and V4 backbones."""
