"""Unit 1 (DDPM): schedules against diffusers, the from-scratch ancestral sampler against DDPMScheduler.step,
training (resume, NaN, architecture mismatch, two processes), bad input, and the digits judge."""
import json, math, os, subprocess, sys, textwrap
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from course_lib.ddpm import (
    AncestralSampler, CheckpointMismatch, DDPMConfig, NoiseSchedule, make_betas, make_scheduler,
    diffusers_scheduler, make_unet, read_checkpoint, sample, train_ddpm, load_pretrained_ddpm)
from course_lib.ddpm import DigitsClassifier, accuracy, judge_samples, load_digits_classifier
from course_lib.data import Digits

DIFFUSERS_NAMES = {"linear": "linear", "cosine": "squaredcos_cap_v2", "sigmoid": "sigmoid"}
# a tiny network so that training tests take a second or two
TINY = dict(block_out_channels=(8, 16), norm_num_groups=8, batch_size=8, lr=3e-3, warmup_steps=3)


# --- schedules -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["linear", "cosine", "sigmoid"])
def test_schedule_matches_diffusers(name):
    from diffusers import DDPMScheduler
    s = NoiseSchedule(1000, name)
    ref = DDPMScheduler(beta_schedule=DIFFUSERS_NAMES[name])
    assert (s.alpha_bar - ref.alphas_cumprod.double()).abs().max() < 1e-5          # diffusers works in float32
    assert torch.equal(diffusers_scheduler(s).betas, s.betas.float())                    # same betas handed over
    # posterior variance against DDPMScheduler._get_variance (fixed_small), relative 1e-3
    t = torch.tensor([1, 10, 500, 999])
    ours = s.posterior_variance[t]
    theirs = torch.stack([ref._get_variance(int(i)) for i in t]).double()
    assert ((ours - theirs).abs() / theirs).max() < 1e-3                      # float32 cancellation in diffusers


def test_q_sample_and_velocity_match_diffusers():
    from diffusers import DDPMScheduler
    s = NoiseSchedule(1000, "cosine")
    ref = diffusers_scheduler(s, DDPMScheduler)
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.rand(6, 1, 8, 8, generator=g) * 2 - 1, torch.randn(6, 1, 8, 8, generator=g)
    t = torch.tensor([0, 1, 100, 500, 900, 999])
    assert (s.q_sample(x0, t, eps) - ref.add_noise(x0, eps, t)).abs().max() < 1e-5
    assert (s.velocity(x0, eps, t) - ref.get_velocity(x0, eps, t)).abs().max() < 1e-5


def test_closed_form_matches_markov_chain():
    # 4000 chains over T = 200 steps: mean and variance of x_t - sqrt(ab) x0 within 5 standard errors
    s = NoiseSchedule(200, "linear", 1e-3, 0.05)
    g = torch.Generator().manual_seed(1)
    x0 = Digits("train", size=8).images[:4000 // 4].repeat(4, 1, 1, 1).double()
    x = x0.clone()
    for t in range(200):
        x = s.q_step(x, torch.full((len(x),), t), generator=g)
        if t in (0, 50, 199):
            mean, var = s.q_mean_variance(x0, torch.full((len(x),), t))
            r = x - mean
            n = len(x)
            assert r.mean(0).abs().max() < 5 * math.sqrt(var[0].item() / n)
            assert (r.var(0) / var[0] - 1).abs().max() < 5 * math.sqrt(2 / n)


# --- the from-scratch sampler against diffusers ------------------------------------------------------------
class FakeUNet(nn.Module):
    "A cheap deterministic stand-in for a UNet2DModel: output depends on x and t, with the attributes `sample` uses."
    def __init__(self, size=8, channels=1):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.8))
        self.config = SimpleNamespace(in_channels=channels, sample_size=size, num_class_embeds=None)
    def forward(self, x, t, class_labels=None):
        t = torch.as_tensor(t, dtype=x.dtype)
        return SimpleNamespace(sample=self.w * torch.tanh(x) + 0.1 * torch.cos(t / 100) * x.flip(-1))


@pytest.mark.parametrize("prediction_type,beta_schedule", [("epsilon", "linear"), ("v_prediction", "cosine")])
def test_ancestral_sampler_matches_ddpm_scheduler_full_trajectory(prediction_type, beta_schedule):
    cfg = DDPMConfig(beta_schedule=beta_schedule, prediction_type=prediction_type)
    model = FakeUNet()
    trajs = {}
    for kind in ("ancestral", "ddpm"):
        xs = []
        sample(model, make_scheduler(kind, cfg), 4, 1000, generator=torch.Generator().manual_seed(3),
               callback=lambda i, t, x: xs.append(x.clone()))
        trajs[kind] = torch.stack(xs)
    assert trajs["ancestral"].shape == (1000, 4, 1, 8, 8)
    assert (trajs["ancestral"] - trajs["ddpm"]).abs().max().item() <= 1e-5
    # and with fewer steps (the 'leading' spacing of diffusers)
    a = sample(model, make_scheduler("ancestral", cfg), 4, 50, generator=torch.Generator().manual_seed(3))[1]
    b = sample(model, make_scheduler("ddpm", cfg), 4, 50, generator=torch.Generator().manual_seed(3))[1]
    assert (a - b).abs().max() <= 1e-5


def test_ancestral_step_with_given_noise():
    s = NoiseSchedule(1000, "linear")
    from diffusers import DDPMScheduler
    ours, ref = AncestralSampler(s), diffusers_scheduler(s, DDPMScheduler)
    ours.set_timesteps(1000); ref.set_timesteps(1000)
    x, out, z = torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8)
    got = ours.step(out, 500, x, variance_noise=z)
    mean = ref.step(out, 500, x, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    want = mean.prev_sample - ref._get_variance(500) ** 0.5 * noise + ref._get_variance(500) ** 0.5 * z
    assert (got.prev_sample - want).abs().max() < 1e-5
    assert (got.pred_original_sample - mean.pred_original_sample).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["ddim", "dpm++", "ancestral"])
def test_sample_with_every_scheduler(kind):
    cfg = DDPMConfig.quick()
    torch.manual_seed(0)
    model = make_unet(cfg)
    u8, x = sample(model, make_scheduler(kind, cfg), 5, 4, generator=torch.Generator().manual_seed(0), batch_size=3)
    assert u8.shape == (5, 1, 8, 8) and u8.dtype == torch.uint8
    assert x.dtype == torch.float32 and x.min() >= -1 and x.max() <= 1
    assert torch.equal(u8, ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8))   # u8 is x, rounded
    u8b, _ = sample(model, make_scheduler(kind, cfg), 5, 4, generator=torch.Generator().manual_seed(0), batch_size=3)
    assert torch.equal(u8, u8b)                                        # reproducible with a generator


def test_sample_class_labels_checked():
    cfg = DDPMConfig.quick(num_classes=3)
    model = make_unet(cfg)
    sch = make_scheduler("ddim", cfg)
    u8, _ = sample(model, sch, 3, 2, class_labels=[0, 1, 2])
    assert u8.shape == (3, 1, 8, 8)
    with pytest.raises(ValueError, match="class_labels"): sample(model, sch, 3, 2)
    with pytest.raises(ValueError, match="class_labels"): sample(model, sch, 3, 2, class_labels=[0, 1, 5])
    with pytest.raises(ValueError, match="not class-conditional"):
        sample(make_unet(DDPMConfig.quick()), sch, 2, 2, class_labels=1)
    with pytest.raises(ValueError, match="eta"): sample(model, make_scheduler("dpm++", cfg), 3, 2, class_labels=0, eta=1.0)


# --- bad input ---------------------------------------------------------------------------------------------
def test_bad_config_errors():
    with pytest.raises(ValueError, match="not divisible by the UNet's downsampling factor 4"):
        DDPMConfig(image_size=10)
    with pytest.raises(ValueError, match="unknown beta_schedule 'quadratic'"): DDPMConfig(beta_schedule="quadratic")
    with pytest.raises(ValueError, match="unknown beta_schedule"): NoiseSchedule(1000, "quadratic")
    with pytest.raises(ValueError, match="unknown prediction_type 'sample'"): DDPMConfig(prediction_type="sample")
    with pytest.raises(ValueError, match="unknown sampler"): make_scheduler("euler", DDPMConfig())
    with pytest.raises(ValueError, match="timesteps must be integers"):
        NoiseSchedule().q_sample(torch.zeros(1, 1, 8, 8), torch.tensor([1000]))
    with pytest.raises(ValueError, match="dataset images have shape"):
        train_ddpm(DDPMConfig(**TINY, steps=1), Digits("train", size=16), progress=False)


def test_checkpoint_from_other_architecture(tmp_path):
    train_ddpm(DDPMConfig(**TINY, steps=2, checkpoint_every=1), checkpoint_dir=tmp_path, progress=False)
    other = DDPMConfig(**{**TINY, "block_out_channels": (16, 16)}, steps=3)
    with pytest.raises(CheckpointMismatch, match="block_out_channels"):
        train_ddpm(other, checkpoint_dir=tmp_path, progress=False)


def test_nan_loss_stops_and_keeps_checkpoint(tmp_path):
    cfg = DDPMConfig(**TINY, steps=6, checkpoint_every=2)
    train_ddpm(DDPMConfig(**TINY, steps=2, checkpoint_every=2), checkpoint_dir=tmp_path, progress=False)
    before = (tmp_path / "checkpoint.safetensors").read_bytes()
    bad = Digits("train", size=8).images.clone()
    bad[:] = float("nan")
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 2; the last good checkpoint .* \(step 2\) is kept"):
        train_ddpm(cfg, bad, checkpoint_dir=tmp_path, progress=False)
    assert (tmp_path / "checkpoint.safetensors").read_bytes() == before
    assert int(read_checkpoint(tmp_path, cfg)[0]["step"]) == 2


# --- training: resume and two processes ----------------------------------------------------------------------
def test_killed_run_resumes_on_the_same_curve(tmp_path):
    cfg = DDPMConfig(**TINY, steps=14, checkpoint_every=4)
    ref = train_ddpm(cfg, progress=False)
    def kill(step, loss):
        if step == 9: raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        train_ddpm(cfg, checkpoint_dir=tmp_path, callback=kill, progress=False)
    assert int(read_checkpoint(tmp_path)[0]["step"]) == 8
    res = train_ddpm(cfg, checkpoint_dir=tmp_path, progress=False)
    assert len(res.history["loss"]) == 14
    assert max(abs(a - b) for a, b in zip(ref.history["loss"], res.history["loss"])) < 1e-5
    for (k, a), b in zip(ref.state_dict().items(), res.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), k                      # same EMA weights at the end


def test_fp16_loss_scale_is_checkpointed_and_resumed(tmp_path):
    """fp16 training keeps a GradScaler whose scale and growth counter are part of the run's state: the checkpoint
    stores it and a resumed run continues it (on 767c4b0 a resumed fp16 run restarted at scale 65536, counter 0).
    The CPU has no fp16 scaler in accelerate, so the test hands the trainer one (torch's CPU GradScaler)."""
    from accelerate import Accelerator
    def accelerator():
        acc = Accelerator(cpu=True)
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        return acc
    cfg = DDPMConfig(**TINY, steps=4, checkpoint_every=4)
    train_ddpm(cfg, checkpoint_dir=tmp_path, progress=False, accelerator=accelerator())
    saved = read_checkpoint(tmp_path)[0]["grad_scaler"]
    assert saved["scale"] == 2.0**11 and saved["_growth_tracker"] == 1, saved    # grew after 3 steps
    acc = accelerator()
    train_ddpm(DDPMConfig(**TINY, steps=6, checkpoint_every=4), checkpoint_dir=tmp_path, progress=False,
               accelerator=acc)
    assert acc.scaler.get_scale() == 2.0**12 and acc.scaler._growth_tracker == 0   # 1 + 2 more: grew again


SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from accelerate import Accelerator
    from course_lib.ddpm import DDPMConfig, train_ddpm
    acc = Accelerator(cpu=True)
    cfg = DDPMConfig(block_out_channels=(8, 16), norm_num_groups=8, steps=30, batch_size=16, lr=5e-3, warmup_steps=3)
    m = train_ddpm(cfg, progress=False, accelerator=acc)
    vec = torch.cat([p.detach().flatten() for p in m.raw_model.parameters()])[None]
    allv = acc.gather(vec)
    losses = acc.gather(torch.tensor(m.history["loss"])[None])
    if acc.is_main_process:
        json.dump({"world": acc.num_processes, "max_param_diff": (allv[0] - allv[1]).abs().max().item(),
                   "losses": losses.tolist()}, open(sys.argv[1], "w"))
""")


def test_two_cpu_processes_keep_identical_weights(tmp_path):
    script, out = tmp_path / "train2.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # torchrun (gloo on CPU); `accelerate launch --multi_gpu --num_processes 2` starts the same torch.distributed run
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world"] == 2
    assert res["max_param_diff"] == 0.0                        # DDP keeps the ranks in lockstep
    for curve in res["losses"]:                                # each rank's loss goes down
        assert sum(curve[-5:]) / 5 < 0.8 * sum(curve[:5]) / 5


# --- the judge ------------------------------------------------------------------------------------------------
def test_classifier_accuracy_and_judge():
    clf = load_digits_classifier()
    assert clf.valid_acc >= 0.97
    assert abs(accuracy(clf) - clf.valid_acc) < 1e-9
    v = Digits("valid", size=16)
    assert clf.features(v.images[:5]).shape == (5, 128) and clf.features(v.images[:5]).dtype == torch.float32
    r = judge_samples(v.images, clf)
    assert set(r) == {"confident_rate", "confident_rate_se", "entropy", "entropy_se", "class_shares", "n"}
    assert r["n"] == len(v)
    assert abs(sum(r["class_shares"]) - 1) < 1e-9 and len(r["class_shares"]) == 10
    assert r["confident_rate"] > 0.8
    r8 = judge_samples(Digits("valid", size=8, dtype="uint8").images, clf)           # uint8 and 8x8 work too
    assert r8["confident_rate"] > 0.7
    noise = judge_samples(torch.rand(200, 1, 16, 16) * 2 - 1, clf)
    assert noise["confident_rate"] < r["confident_rate"] - 0.3
    assert noise["entropy"] > r["entropy"] + 10 * (noise["entropy_se"] + r["entropy_se"])


def test_judge_entropy_and_standard_errors_match_scipy():
    from scipy import stats
    clf = load_digits_classifier()
    x = Digits("valid", size=16).images[:100]
    r = judge_samples(x, clf)
    with torch.no_grad():
        probs = torch.softmax(clf(x), -1).double().numpy()
    bits = stats.entropy(probs, base=2, axis=1)                       # the reference
    assert abs(r["entropy"] - bits.mean()) < 1e-6
    assert abs(r["entropy_se"] - stats.sem(bits)) < 1e-6
    p = r["confident_rate"]
    assert abs(r["confident_rate_se"] - (p * (1 - p) / 100) ** 0.5) < 1e-12
    assert 0 <= r["entropy"] <= math.log2(10)
    with pytest.raises(ValueError, match="expects"): judge_samples(torch.zeros(0, 1, 16, 16), clf)
    with pytest.raises(ValueError, match="square grey"): clf(torch.zeros(2, 3, 16, 16))


def test_quick_model_beats_untrained():
    cfg = DDPMConfig.quick()
    trained = load_pretrained_ddpm(cfg, progress=False)
    torch.manual_seed(0)
    untrained = make_unet(cfg)
    g = lambda: torch.Generator().manual_seed(0)
    a = judge_samples(sample(trained, make_scheduler("dpm++", cfg), 128, 20, generator=g())[0])
    b = judge_samples(sample(untrained, make_scheduler("dpm++", cfg), 128, 20, generator=g())[0])
    assert a["confident_rate"] > b["confident_rate"] + 0.1, (a, b)
    assert max(a["class_shares"]) < max(b["class_shares"]) or max(a["class_shares"]) < 0.3


def test_grey_share_counts_pixels_strictly_between_10_and_90_percent_ink():
    "Lesson 13's grey share, on images whose share is known; uint8 and float images of the same pixels agree."
    from course_lib.ddpm import grey_share
    u8 = torch.zeros(4, 1, 10, 10, dtype=torch.uint8)
    u8[1] = 255                                    # all stroke: 0
    u8[2] = 128                                    # all mid-grey: 1
    u8[3, 0, :3] = 128                             # 30 of 100 pixels grey, the rest background: 0.3
    u8[3, 0, 3:5] = 255
    torch.testing.assert_close(grey_share(u8), torch.tensor([0.0, 0.0, 1.0, 0.3], dtype=torch.float64))
    torch.testing.assert_close(grey_share(u8.float() / 127.5 - 1), grey_share(u8))
    # the grey levels either side of 10% (25.5) and 90% (229.5) of 255: only 26 and 229 are grey
    assert grey_share(torch.tensor([25, 26, 229, 230], dtype=torch.uint8).view(1, 1, 2, 2)).item() == 0.5
    assert grey_share(torch.zeros(2, 3, 4, 4)).shape == (2,)   # RGB: every channel's pixels counted
