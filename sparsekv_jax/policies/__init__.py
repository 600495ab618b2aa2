"""KV selection policies: one file per method, composed with `Pipeline`.

See `base.Policy` for the stages and `spec` for naming policies on the command line.
"""

from sparsekv_jax.policies.adakv import AdaKV
from sparsekv_jax.policies.base import ContextResult, Dense, FullKV, Policy, Prompt, Setup
from sparsekv_jax.policies.bser import BSER
from sparsekv_jax.policies.chess import CHESS
from sparsekv_jax.policies.h2o import H2O
from sparsekv_jax.policies.headsplit import HeadSplit
from sparsekv_jax.policies.pipeline import Pipeline
from sparsekv_jax.policies.pyramidkv import PyramidKV
from sparsekv_jax.policies.quest import Quest
from sparsekv_jax.policies.retrieval import BM25Retrieval, DenseRAG
from sparsekv_jax.policies.s3 import S3Hybrid, S3Pure
from sparsekv_jax.policies.scored import ScoredCompression
from sparsekv_jax.policies.semanticache import SemantiCache
from sparsekv_jax.policies.snapkv import SnapKV
from sparsekv_jax.policies.spec import parse_policies, parse_policy, register
from sparsekv_jax.policies.stem import Stem
from sparsekv_jax.policies.streaming_llm import StreamingLLM

for _name, _factory in (("fullkv", FullKV), ("dense", Dense), ("streamingllm", StreamingLLM),
                        ("streaming_llm", StreamingLLM), ("snapkv", SnapKV), ("h2o", H2O), ("quest", Quest),
                        ("pipeline", Pipeline), ("stem", Stem), ("chess", CHESS.from_spec), ("bser", BSER),
                        ("semanticache", SemantiCache), ("s3pure", S3Pure), ("s3hybrid", S3Hybrid),
                        ("bm25", BM25Retrieval), ("rag", DenseRAG), ("adakv", AdaKV), ("pyramidkv", PyramidKV),
                        ("headsplit", HeadSplit)):
    register(_name, _factory)

__all__ = ["AdaKV", "BM25Retrieval", "BSER", "CHESS", "H2O", "HeadSplit", "ContextResult", "Dense", "DenseRAG",
           "FullKV", "Pipeline", "Policy", "Prompt", "PyramidKV", "Quest", "S3Hybrid", "S3Pure", "ScoredCompression",
           "SemantiCache", "Setup", "SnapKV", "Stem", "StreamingLLM", "parse_policies", "parse_policy", "register"]
