"""course_lib.ddpm.unet (lesson 10a, a UNet by hand): each piece against the library practitioners use (the timestep
embedding against diffusers' `get_timestep_embedding` to 1e-6, the ResBlock against diffusers' `ResnetBlock2D`,
attention against torch's `scaled_dot_product_attention` and `nn.MultiheadAttention` to 1e-5), the output shape
and dtype of `TinyUNet` on odd sizes, and a clear error, naming the value, for each input it cannot take."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib.ddpm import ResBlock, SelfAttention, TinyUNet, check_unet_sizes, timestep_embedding


# --- the timestep embedding against diffusers --------------------------------------------------------------------

@pytest.mark.parametrize("dim,flip,shift", [(d, f, s) for d in (2, 16, 17, 64) for f, s in
                                            [(True, 0), (False, 1), (True, 1), (False, 0)]
                                            if not (d == 2 and s == 1)])   # dim/2 - shift = 0 divides by 0
def test_timestep_embedding_matches_diffusers(dim, flip, shift):
    from diffusers.models.embeddings import get_timestep_embedding
    t = torch.tensor([0, 1, 7, 250, 999])
    ours = timestep_embedding(t, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift)
    theirs = get_timestep_embedding(t, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift)
    assert ours.shape == theirs.shape == (5, dim) and ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() < 1e-6


def test_timestep_embedding_takes_float_timesteps_and_max_period():
    from diffusers.models.embeddings import get_timestep_embedding
    t = torch.tensor([0.5, 3.25, 900.0])
    ours = timestep_embedding(t, 32, max_period=1000.0)
    theirs = get_timestep_embedding(t, 32, flip_sin_to_cos=True, downscale_freq_shift=0, max_period=1000)
    assert (ours - theirs).abs().max().item() < 1e-6


def test_timestep_embedding_refuses_a_2d_t_naming_its_shape():
    with pytest.raises(ValueError, match=r"1-D.*\(2, 1\)"):
        timestep_embedding(torch.zeros(2, 1, dtype=torch.long), 16)


# --- the ResBlock and the attention against diffusers and torch ---------------------------------------------------

@pytest.mark.parametrize("c_out", [16, 32])
def test_resblock_matches_diffusers_resnet_block(c_out):
    from diffusers.models.resnet import ResnetBlock2D
    torch.manual_seed(0)
    theirs = ResnetBlock2D(in_channels=16, out_channels=c_out, temb_channels=64, groups=8, eps=1e-5).eval()
    ours = ResBlock(16, c_out, 64, groups=8)
    ours.load_state_dict(theirs.state_dict())          # the same layer names, so the weights load as they are
    x, emb = torch.randn(3, 16, 6, 10), torch.randn(3, 64)
    with torch.no_grad():
        assert (ours(x, emb) - theirs(x, emb)).abs().max().item() < 1e-5


def _qkv(attn: SelfAttention, x: torch.Tensor):
    B, C, H, W = x.shape
    tokens = attn.group_norm(x).flatten(2).transpose(1, 2)
    split = lambda z: z.reshape(B, H * W, attn.heads, -1).transpose(1, 2)
    return tokens, split(attn.to_q(tokens)), split(attn.to_k(tokens)), split(attn.to_v(tokens))


@pytest.mark.parametrize("channels,head_dim,hw", [(32, 8, (4, 4)), (32, 16, (2, 3)), (16, 16, (1, 1))])
def test_attention_matches_scaled_dot_product_attention(channels, head_dim, hw):
    torch.manual_seed(0)
    attn = SelfAttention(channels, head_dim=head_dim, groups=8)
    x = torch.randn(2, channels, *hw)
    with torch.no_grad():
        _, q, k, v = _qkv(attn, x)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, -1, channels)
        theirs = x + attn.to_out(o).transpose(1, 2).reshape(x.shape)
        assert attn.heads == channels // head_dim
        assert (attn(x) - theirs).abs().max().item() < 1e-5


def test_attention_matches_multihead_attention():
    torch.manual_seed(0)
    attn = SelfAttention(32, head_dim=8, groups=8)
    mha = nn.MultiheadAttention(32, num_heads=4, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
        mha.in_proj_bias.copy_(torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]))
        mha.out_proj.load_state_dict(attn.to_out.state_dict())
        x = torch.randn(3, 32, 4, 4)
        tokens = _qkv(attn, x)[0]
        theirs = x + mha(tokens, tokens, tokens)[0].transpose(1, 2).reshape(x.shape)
        assert (attn(x) - theirs).abs().max().item() < 1e-5


# --- TinyUNet: shapes, dtypes, timesteps, the course's sampler -----------------------------------------------------

@pytest.mark.parametrize("chs,in_channels,hw", [((8,), 1, (7, 7)), ((8, 16), 3, (6, 10)),
                                               ((16, 32, 32), 1, (12, 20)), ((16, 32, 32), 1, (8, 8))])
def test_output_shape_for_odd_sizes(chs, in_channels, hw):
    torch.manual_seed(0)
    net = TinyUNet(sample_size=hw[0], in_channels=in_channels, block_out_channels=chs, norm_num_groups=8)
    x = torch.randn(3, in_channels, *hw)
    with torch.no_grad():
        out = net(x, torch.tensor([0, 500, 999])).sample
    assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_output_dtype_follows_the_model_and_timesteps_broadcast():
    torch.manual_seed(0)
    net = TinyUNet().double()
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        a = net(x, torch.tensor([5, 5])).sample
        b = net(x, 5).sample                       # one int for the batch, as a scheduler passes it
        c = net(x, torch.tensor(5)).sample          # a 0-dim tensor
    assert a.dtype == torch.float64
    assert torch.equal(a, b) and torch.equal(a, c)


def test_the_time_changes_the_output():
    torch.manual_seed(0)
    net = TinyUNet()
    x = torch.randn(1, 1, 8, 8).expand(2, -1, -1, -1)
    with torch.no_grad():
        out = net(x, torch.tensor([10, 900])).sample
    assert (out[0] - out[1]).abs().max().item() > 1e-3


def test_course_sampler_drives_tiny_unet():
    from course_lib.ddpm import DDPMConfig, make_scheduler, sample
    cfg = DDPMConfig.quick(beta_schedule="linear", prediction_type="epsilon")
    torch.manual_seed(0)
    u8, x = sample(TinyUNet(), make_scheduler("dpm++", cfg), 4, 3, generator=torch.Generator().manual_seed(0))
    assert u8.shape == (4, 1, 8, 8) and u8.dtype == torch.uint8 and x.dtype == torch.float32


# --- clear errors that name the value ------------------------------------------------------------------------------

def test_channels_not_divisible_by_the_groups_are_named():
    with pytest.raises(ValueError, match=r"\[20\].*norm_num_groups=8"):
        TinyUNet(block_out_channels=(16, 20, 32), norm_num_groups=8)
    with pytest.raises(ValueError, match=r"12 channels.*8 GroupNorm groups"):
        ResBlock(12, 16, 64, groups=8)
    with pytest.raises(ValueError, match=r"channels=20.*head_dim=8"):
        SelfAttention(20, head_dim=8, groups=4)


def test_an_image_size_the_down_path_cannot_halve_is_named():
    with pytest.raises(ValueError, match=r"sample_size=10 cannot be halved 2 times.*multiple of 4"):
        TinyUNet(sample_size=10, block_out_channels=(16, 32, 32))
    with pytest.raises(ValueError, match=r"sample_size=7"):
        check_unet_sizes(7, (8, 16), 8)
    net = TinyUNet()
    with pytest.raises(ValueError, match=r"\(2, 1, 8, 6\).*multiples of 4"):
        net(torch.randn(2, 1, 8, 6), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"\(1, 8, 8\)"):
        net(torch.randn(1, 8, 8), torch.tensor([1]))


def test_class_labels_are_refused():
    with pytest.raises(ValueError, match="not class-conditional"):
        TinyUNet()(torch.randn(1, 1, 8, 8), 3, class_labels=torch.tensor([1]))


# --- lesson 10a's comparison run: the training loop against diffusers, the cache ----------------------------------

def test_train_eps_first_loss_is_l_simple_with_diffusers_noising():
    """The first loss `train_eps` reports is L_simple on x_t made by diffusers' `DDPMScheduler.add_noise` from the
    same draws (the generator's batch indices, timesteps and noise, in the loop's order), to 1e-5."""
    import copy
    from diffusers import DDPMScheduler
    from course_lib.ddpm import UNetPairConfig, train_eps
    pair = UNetPairConfig(data="digits")
    model = pair.models()["TinyUNet"]
    x_train = pair.dataset().images
    before = copy.deepcopy(model).eval()
    losses = train_eps(model, x_train, pair.ddpm_config().schedule(), 2, batch_size=8, seed=3, progress=False)
    gen = torch.Generator().manual_seed(3)
    x0 = x_train[torch.randint(len(x_train), (8,), generator=gen)]
    t = torch.randint(0, 1000, (8,), generator=gen)
    eps = torch.randn(x0.shape, generator=gen)
    xt = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear").add_noise(x0, eps, t)
    with torch.no_grad():
        want = F.mse_loss(before.train()(xt, t).sample, eps).item()
    assert len(losses) == 2 and abs(losses[0] - want) < 1e-5, (losses[0], want)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters()))


def test_train_eps_gives_two_models_the_same_batches():
    "Same arguments, same initial weights: the same losses, step by step; another seed, other batches."
    from course_lib.ddpm import UNetPairConfig, train_eps
    pair = UNetPairConfig(data="digits")
    x, sched = pair.dataset().images, pair.ddpm_config().schedule()
    run = [train_eps(pair.models()["UNet2DModel"], x, sched, 3, 8, seed=s, progress=False) for s in (0, 0, 1)]
    assert run[0] == run[1] and run[0] != run[2]


@pytest.mark.parametrize("kw,match", [
    (dict(data="cifar"), "data='cifar'"), (dict(data="MNIST"), "data='MNIST'"),
    (dict(steps=0), "steps must be an int >= 1, got 0"), (dict(steps=2.5), "steps .* got 2.5"),
    (dict(batch_size=True), "batch_size .* got True"), (dict(lr=0), "lr must be a finite number > 0, got 0"),
    (dict(lr="big"), "lr .* got 'big'"), (dict(widths=(16, 30, 32)), r"widths=\(16, 30, 32\).*\[30\]"),
    (dict(widths=(16, 32, 32, 32)), r"widths=.*image_size=28"), (dict(widths=()), "widths=\(\)"),
    (dict(tiny_widths=(16, 32, 44)), r"tiny_widths=\(16, 32, 44\).*\[44\]"),
    # a new user's inputs that passed the first version of the check and failed later, or trained NaNs
    (dict(tiny_widths=(0,)), r"tiny_widths must be a tuple of ints >= 1"), (dict(widths=(16, 32, -32)), "widths"),
    (dict(widths=(16.0, 32, 32)), "widths must be"), (dict(tiny_widths=(16, 32, 40.0)), "tiny_widths must be"),
    (dict(widths="abc"), "widths must be"), (dict(lr=float("inf")), "lr must be a finite number"),
    (dict(seed="a"), "seed must be an int >= 0, got 'a'"), (dict(seed=None), "seed .* got None"),
    (dict(seed=1.5), "seed .* got 1.5"), (dict(code_version="x"), "code_version .* got 'x'")])
def test_unet_pair_config_names_what_it_cannot_train(kw, match):
    "Each field `load_unet_pair` could not train with is refused at construction, named with its value."
    from course_lib.ddpm import UNetPairConfig
    with pytest.raises(ValueError, match=match):
        UNetPairConfig(**kw)


def test_unet_pair_configs_are_keyed_apart(monkeypatch, tmp_path):
    from course_lib.ddpm import UNetPairConfig
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path))
    assert UNetPairConfig(widths=[16, 32, 32]).path() == UNetPairConfig().path()     # a list from JSON: same key
    paths = {UNetPairConfig().path(), UNetPairConfig(data="digits").path(), UNetPairConfig(steps=10).path(),
             UNetPairConfig(seed=1).path(), UNetPairConfig(tiny_widths=(16, 32, 48)).path()}
    assert len(paths) == 5
    sizes = {k: sum(p.numel() for p in m.parameters()) for k, m in UNetPairConfig().models().items()}
    assert abs(sizes["TinyUNet"] / sizes["UNet2DModel"] - 1) < 0.05, sizes


def test_load_unet_pair_trains_once_then_loads(monkeypatch, tmp_path):
    "A miss trains both and caches them; the next call loads the same weights and history without training."
    import course_lib.ddpm.pretrained as pretrained
    from course_lib.ddpm import UNetPairConfig, load_unet_pair
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path))
    monkeypatch.setenv("COURSE_LIB_NO_PRETRAINED", "1")
    cfg = UNetPairConfig(data="digits", steps=3, batch_size=8)
    first, h1 = load_unet_pair(cfg)
    assert cfg.path().is_file() and {len(v) for v in h1["losses"].values()} == {3}

    def no_training(*a, **k): raise AssertionError("trained on a cache hit")
    monkeypatch.setattr(pretrained, "train_eps", no_training)
    second, h2 = load_unet_pair(cfg)
    assert h2 == h1 and not second["TinyUNet"].training
    for k in first:
        for a, b in zip(first[k].state_dict().values(), second[k].state_dict().values()):
            assert torch.equal(a, b)


def test_a_list_of_widths_is_stored_as_a_tuple():
    "A config read from JSON (lists) is hashable, and keys as the tuple does (above)."
    from course_lib.ddpm import UNetPairConfig
    c = UNetPairConfig(widths=[16, 32, 32], tiny_widths=[16, 32, 40])
    assert c == UNetPairConfig() and hash(c) == hash(UNetPairConfig())


def test_load_unet_pair_trains_the_networks_it_is_given(monkeypatch, tmp_path):
    """Lesson 10a passes the TinyUNet its reader wrote: that class is trained and returned; networks of other
    widths are refused before any training, naming the network."""
    from course_lib.ddpm import TinyUNet, UNetPairConfig, load_unet_pair
    monkeypatch.setenv("COURSE_LIB_HOME", str(tmp_path))
    monkeypatch.setenv("COURSE_LIB_NO_PRETRAINED", "1")

    class MyTinyUNet(TinyUNet):
        pass
    cfg = UNetPairConfig(data="digits", steps=2, batch_size=4)
    models, _ = load_unet_pair(cfg, models=cfg.models(MyTinyUNet))
    assert type(models["TinyUNet"]) is MyTinyUNet
    wider = UNetPairConfig(data="digits", steps=2, batch_size=4, tiny_widths=(16, 32, 48)).models()
    with pytest.raises(ValueError, match=r"models\['TinyUNet'\] has other parameters"):
        load_unet_pair(cfg, models=wider)
    with pytest.raises(ValueError, match="keys 'TinyUNet' and 'UNet2DModel'"):
        load_unet_pair(cfg, models={"TinyUNet": models["TinyUNet"]})


def test_lesson_10as_tiny_unet_in_a_kernel_has_the_modules_fingerprint():
    """Lesson 10a's export cells define TinyUNet in the kernel and hand that class to `load_unet_pair`, which
    records its code with `train_eps`'s: the same code must give the module's fingerprint, or the shipped pair
    would warn that its code changed on every full-profile run."""
    import json
    from pathlib import Path
    execnb = pytest.importorskip("execnb.shell")
    import course_lib.ddpm.unet as U
    from course_lib.core import code_fingerprint
    nb = json.loads((Path(__file__).resolve().parent.parent / "nbs" / "10a_unet.ipynb").read_text())
    sh = execnb.CaptureShell()
    for c in nb["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] == "code" and src.startswith("#| export"):
            sh.run(src)
            assert sh.exc is None, sh.exc
    show = ("from course_lib.core.cache import code_fingerprint\nimport course_lib.ddpm.unet as U\n"
            "print(TinyUNet.__module__, TinyUNet is U.TinyUNet, code_fingerprint(U.train_eps, TinyUNet))")
    module, same_class, fp = "".join(sh.run(show)[0]["text"]).split()
    assert (module, same_class) == ("__main__", "False")
    assert fp == code_fingerprint(U.train_eps, U.TinyUNet)
