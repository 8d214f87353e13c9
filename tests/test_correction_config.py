"""CorrectionConfig: paper defaults, OmegaConf structured use, dotted-key validation errors."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from common.errors import ConfigError
from correction import (CorrectionConfig, CorrectionMethod, ISLevel, ISMode, KLEstimator,
                        LossAggregation)


def test_defaults_are_the_sparse_rl_recipe():
    c = CorrectionConfig()
    c.validate()
    assert c.method == CorrectionMethod.SPARSE_RL and c.log_ratio_clamp == 20.0
    assert (c.is_.level, c.is_.mode, c.is_.upper, c.is_.normalize) == \
        (ISLevel.TOKEN, ISMode.TRUNCATE, 1.5, True)
    assert (c.rejection.enabled, c.rejection.lower, c.rejection.upper,
            c.rejection.veto_threshold) == (True, 0.5, 1.5, 1e-4)
    assert c.tis.cap == 2.0
    assert (c.loss.clip_eps_low, c.loss.clip_eps_high, c.loss.kl_estimator,
            c.loss.aggregation) == (0.2, 0.2, KLEstimator.K3, LossAggregation.TOKEN_MEAN)
    assert c.advantage.normalize_std is True


def test_omegaconf_structured_with_yaml_strings():
    base = OmegaConf.structured(CorrectionConfig)
    over = OmegaConf.create("method: seq_mask_tis\nis_:\n  level: geometric\n  mode: mask\n"
                            "loss:\n  clip_eps_high: 0.28\n  dual_clip_c: 3.0\n"
                            "  aggregation: seq_mean\nstaleness:\n  lag_scaling: linear\n")
    cfg = OmegaConf.to_object(OmegaConf.merge(base, over))
    assert isinstance(cfg, CorrectionConfig)
    assert cfg.method == CorrectionMethod.SEQ_MASK_TIS and cfg.is_.level == ISLevel.GEOMETRIC
    assert cfg.loss.dual_clip_c == 3.0 and cfg.loss.aggregation == LossAggregation.SEQ_MEAN
    cfg.validate()
    with pytest.raises(ValidationError):
        OmegaConf.merge(base, OmegaConf.create({"method": "sparse-rl"}))


@pytest.mark.parametrize("path,value,key", [
    ("rejection.lower", 1.5, "correction.rejection.lower"),
    ("rejection.upper", 0.4, "correction.rejection.upper"),
    ("rejection.veto_threshold", -1.0, "correction.rejection.veto_threshold"),
    ("rejection.min_kept_share", 1.5, "correction.rejection.min_kept_share"),
    ("is_.upper", 0.5, "correction.is_.upper"),
    ("is_.mode", "chop", "correction.is_.mode"),
    ("is_.normalize_over", "all", "correction.is_.normalize_over"),
    ("method", "magic", "correction.method"),
    ("log_ratio_clamp", 0.0, "correction.log_ratio_clamp"),
    ("tis.cap", 0.9, "correction.tis.cap"),
    ("icepop.upper", 0.3, "correction.icepop.upper"),
    ("seq_mask_tis.lower", 2.0, "correction.seq_mask_tis.lower"),
    ("staleness.max_lag", -1, "correction.staleness.max_lag"),
    ("staleness.lag_scaling", "cubic", "correction.staleness.lag_scaling"),
    ("loss.clip_eps_low", 1.0, "correction.loss.clip_eps_low"),
    ("loss.clip_eps_high", -0.1, "correction.loss.clip_eps_high"),
    ("loss.dual_clip_c", 1.0, "correction.loss.dual_clip_c"),
    ("loss.kl_coef", -0.1, "correction.loss.kl_coef"),
    ("loss.kl_estimator", "k4", "correction.loss.kl_estimator"),
    ("loss.entropy_coef", -1.0, "correction.loss.entropy_coef"),
    ("loss.aggregation", "sum", "correction.loss.aggregation"),
    ("advantage.eps", 0.0, "correction.advantage.eps"),
])
def test_validate_names_the_dotted_key(path, value, key):
    cfg = CorrectionConfig()
    *parents, leaf = path.split(".")
    obj = cfg
    for p in parents:
        obj = getattr(obj, p)
    setattr(obj, leaf, value)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert e.value.key == key


def test_custom_prefix():
    cfg = CorrectionConfig()
    cfg.rejection.lower = -0.1
    with pytest.raises(ConfigError, match="train.correction.rejection.lower"):
        cfg.validate("train.correction")
