import pytest
from omegaconf import OmegaConf

from buffer.config import BufferConfig, PodsConfig, StalePolicy
from common.errors import ConfigError


def test_defaults_validate_and_structured_merge():
    BufferConfig().validate()
    base = OmegaConf.structured(BufferConfig)
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(
        ["stale_policy=requeue", "pods.enabled=true", "pods.keep=2", "root=/tmp/buf"]))
    cfg = OmegaConf.to_object(merged)
    assert cfg.stale_policy is StalePolicy.REQUEUE and cfg.pods == PodsConfig(True, 2)
    cfg.validate()


@pytest.mark.parametrize("field,value,key", [
    ("capacity", 0, "buffer.capacity"),
    ("max_staleness", -1, "buffer.max_staleness"),
    ("segment_rows", 0, "buffer.segment_rows"),
    ("scoring_lease_s", 0.0, "buffer.scoring_lease_s"),
    ("stale_policy", "sometimes", "buffer.stale_policy"),
    ("root", "  ", "buffer.root"),
])
def test_validate_names_dotted_key(field, value, key):
    cfg = BufferConfig(**{field: value})
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert e.value.key == key and key in str(e.value)


def test_pods_keep_checked_against_group_size():
    with pytest.raises(ConfigError, match="buffer.pods.keep"):
        BufferConfig(pods=PodsConfig(True, 0)).validate()
    with pytest.raises(ConfigError, match="buffer.pods.keep"):
        BufferConfig(group_size=4, pods=PodsConfig(True, 8)).validate()
    cfg = BufferConfig(stale_policy="drop")
    cfg.validate()                       # a plain string from a dict is normalised
    assert cfg.stale_policy is StalePolicy.DROP
