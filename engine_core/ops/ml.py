"""ai.onnx.ml domain ops (LabelEncoder, TreeEnsemble, Binarizer, ArrayFeatureExtractor, TfIdfVectorizer)."""

from __future__ import annotations
