"""Data families, one module each: real-format readers, offline real stand-ins, planted synthetic data.

  codesearch  CosQA / AdvTest / CodeSearchNet files as UniXcoder reads them; the stdlib docstring→code stand-in
  sts         SentEval STS12–16, STS-B, SICK-R; the gensim-wheel stand-ins (not STS)
  howto100m   per-video features and captions, MIL-NCE bags; the python-doc narrated stand-in
"""
