# AMP001 manual-cast: .half()/.bfloat16()/.to(torch.float16) in training code.
import copy

import numpy as np
import torch
import torch as th
from torch import float16

scaler = torch.amp.GradScaler("cuda")


# ---- positives --------------------------------------------------------------------


def train_model_half(model, loader, optimizer):
    model.half()  # AMP001
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        optimizer.step()


def train_inputs_half(model, loader, optimizer):
    for x, y in loader:
        x = x.half()  # AMP001
        model(x, y).backward()
        optimizer.step()


def train_bfloat16(model, loader, optimizer):
    model = model.cuda().bfloat16()  # AMP001
    for x, y in loader:
        model(x, y).backward()


def to_positional_dtype(model, loader):
    model.to(torch.float16)  # AMP001
    for x, y in loader:
        model(x, y).backward()


def to_keyword_dtype(model, loader):
    model.to(dtype=torch.bfloat16)  # AMP001
    for x, y in loader:
        model(x, y).backward()


def to_device_and_dtype(model, loader, device):
    model.to(device, torch.half)  # AMP001
    for x, y in loader:
        model(x, y).backward()


def to_device_keyword_and_dtype(model, loader, device):
    model = model.to(device=device, dtype=torch.float16)  # AMP001
    for x, y in loader:
        model(x, y).backward()


def type_half_tensor(model, loader):
    for x, y in loader:
        x = x.type(torch.HalfTensor)  # AMP001
        model(x, y).backward()


def type_cuda_half_tensor(model, loader):
    for x, y in loader:
        x = x.type(torch.cuda.HalfTensor)  # AMP001
        model(x, y).backward()


def imported_dtype_name(model, loader):
    model.to(float16)  # AMP001
    for x, y in loader:
        model(x, y).backward()


def aliased_torch(model, loader):
    model.to(th.float16)  # AMP001
    for x, y in loader:
        model(x, y).backward()


def chained_device_then_half(model, loader, device):
    for x, y in loader:
        inputs = x.to(device, non_blocking=True).half()  # AMP001
        loss = model(inputs, y)
        loss.backward()


class Trainer:
    def __init__(self, model, optimizer):
        self.model = model.half()  # AMP001
        self.optimizer = optimizer

    def run_epoch(self, loader):
        for x, y in loader:
            self.model(x, y).backward()
            self.optimizer.step()


class LitModel:
    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.net(x.half(), y)  # AMP001


def fit(net, data, epochs):
    net.half()  # AMP001
    for _ in range(epochs):
        for x, y in data:
            net(x, y).backward()


def main_loop(model, loader, optimizer):
    model.cuda().half()  # AMP001
    optimizer.zero_grad()
    for x, y in loader:
        scaler.scale(model(x, y)).backward()


def main(args):
    model = build_model(args)
    model = model.half()  # AMP001
    train_one_epoch(model, args)



def train_model_evaluated_then_trained(model, loader, optimizer):
    model.eval()
    model.half()  # AMP001
    model.train()
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()



def train_with_frozen_batchnorm_only(model, loader, optimizer, freeze_bn):
    freeze_bn(model)
    model.half()  # AMP001
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()



def main_trains_then_evaluates(model, loader):
    model = model.half()  # AMP001
    train_one_epoch(model, loader)
    model.eval()


def optimizer_over_model_evaluated_later(model, loader):
    model.half()  # AMP001
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()
    model.eval()


# ---- negatives --------------------------------------------------------------------


def predict(model, x):
    model.half()
    return model(x.half())


@torch.no_grad()
def evaluate_epoch(model, loader):
    model.half()
    return [model(x) for x, _ in loader]


def train_with_inference_block(model, loader):
    for x, y in loader:
        model(x, y).backward()
    with torch.inference_mode():
        model.half()


def export_onnx(model, path):
    model.half()
    torch.onnx.export(model, torch.zeros(1, 3, dtype=torch.float16), path)


def train_round_trip(model, loader):
    for x, y in loader:
        x = x.half().float()
        model(x, y).backward()


def train_rounding_simulation(model, loader, orig_dtype):
    for x, y in loader:
        x = x.half().to(orig_dtype)
        model(x.bfloat16().type_as(y), y).backward()


def finetune_cast_then_moved(args, loader):
    model = create_model(args.arch)
    model = model.half().to(args.device)  # AMP001
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()


def train_tensor_creation(model, loader):
    for x, y in loader:
        noise = torch.randn(x.shape, dtype=torch.float16, device=x.device)
        model(x + noise, y).backward()


class HalfOverride(torch.nn.Module):
    def half(self):
        self.norm.float()
        return super().half()

    def train_step(self, x):
        return self(x).backward()


def save_checkpoint(model, optimizer, path):
    torch.save({"model": copy.deepcopy(model).half(), "optimizer": optimizer.state_dict()}, path)


def strip_optimizer(f="best.pt"):
    x = torch.load(f)
    x["model"].half()
    torch.save(x, f)


def train_pure_fp16_flag(model, loader, args):
    if args.fp16:
        model.half()
    for x, y in loader:
        model(x, y).backward()


def train_precision_mode(model, loader, precision):
    if precision == "pure_fp16":
        model = model.half()
    for x, y in loader:
        model(x, y).backward()


def train_conditional_inputs(model, loader, half):
    for x, y in loader:
        x = x.half() if half else x.float()
        model(x, y).backward()


def to_half_utility(tensor):
    return tensor.half()


def train_upcast_and_move(model, loader, device, dtype):
    for x, y in loader:
        x = x.to(device).to(torch.float32).to(dtype)
        model(x, y).backward()


def eval_script(model, loader):
    model.eval()
    model.half()
    return [model(x) for x in loader]


class Fraction:
    def __init__(self, value):
        self.value = value

    def half(self):
        return Fraction(self.value / 2)


def train_with_user_object(model, loader):
    amount = Fraction(3)
    amount = amount.half()
    for x, y in loader:
        model(x, y).backward()


def train_numpy_halves(model, loader):
    for x, y in loader:
        weights = np.ones(3).astype(np.float16)
        model(x, y, weights).backward()


class Generator:
    def generate(self, prompt):
        self.model.half()
        return self.model(prompt)


def train_with_autocast(model, loader, optimizer):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def documented_only(model):
    """Never call model.half() in training; use torch.autocast instead."""
    return model


def build_model(args):
    model = make_network(args)
    return model.half() if args.half_weights else model


def make_network(args):
    net = args.factory()
    net.eval()
    return net.half()


def train_one_epoch(model, args):
    for x, y in args.loader:
        model(x, y).backward()


def load_for_serving(path):
    model = torch.load(path)
    model.half()
    model.eval()
    return model


def train_with_frozen_teacher(student, teacher, loader, optimizer):
    teacher = teacher.half().eval()
    for x, y in loader:
        with torch.no_grad():
            soft = teacher(x.half()).float()
        (student(x) - soft).pow(2).mean().backward()
        optimizer.step()


def train_head_on_frozen_encoder(encoder, head, loader, optimizer):
    for p in encoder.parameters():
        p.requires_grad = False
    encoder.to(torch.bfloat16)
    for x, y in loader:
        head(encoder(x.to(torch.bfloat16)).float(), y).backward()
        optimizer.step()


def train_against_reference(policy, ref_model, loader, optimizer):
    reference = ref_model.to(torch.bfloat16)
    reference.requires_grad_(False)
    for x in loader:
        (policy(x) - reference(x).float()).mean().backward()
        optimizer.step()


def train_caching_detached_features(model, loader, optimizer, cache):
    for i, (x, y) in enumerate(loader):
        feats = model.backbone(x)
        cache[i] = feats.detach().half()
        model.head(feats, y).backward()
        optimizer.step()


def train_perceptual_with_helper_frozen_net(gen, vgg, loader, optimizer, set_requires_grad):
    set_requires_grad(vgg, False)
    vgg.half()
    for x, y in loader:
        (vgg(gen(x).half()) - vgg(y.half())).abs().mean().backward()
        optimizer.step()


def train_embeddings_with_frozen_unet(vae, unet, loader, optimizer, freeze_params):
    freeze_params(vae.parameters())
    freeze_params(unet.parameters())
    vae.to(dtype=torch.float16)
    unet.to(dtype=torch.float16)
    for batch in loader:
        latents = vae.encode(batch["pixels"].to(dtype=torch.float16))
        (unet(latents).float() - batch["noise"]).pow(2).mean().backward()
        optimizer.step()


# ---- casts as a dtype-flow fact: any spelling of a conversion to fp16/bf16 ---------

HALF = th.float16
BF16 = torch.bfloat16
CUDA_HALF = "torch.cuda.HalfTensor"


def train_input_to_float16(model, loader, optimizer):
    for x, y in loader:
        x = x.to(torch.float16)  # AMP001
        model(x, y).backward()
        optimizer.step()


def train_model_to_device_and_bf16(model, loader, optimizer, device):
    model = model.to(device, dtype=torch.bfloat16)  # AMP001
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()


def train_batch_images_cuda_half_tensor(model, loader, optimizer):
    for batch in loader:
        images = batch["images"].type(torch.cuda.HalfTensor)  # AMP001
        model(images, batch["labels"]).backward()
        optimizer.step()


def train_type_string(model, loader, optimizer):
    for batch in loader:
        images = batch["images"].type("torch.cuda.HalfTensor")  # AMP001
        model(images).backward()
        optimizer.step()


def train_named_constants(model, loader, optimizer):
    for x, y in loader:
        x = x.to(HALF)  # AMP001
        y = y.type(CUDA_HALF)  # AMP001
        model(x, y).backward()
        optimizer.step()


def train_model_to_named_bf16(model, loader, optimizer):
    model.to(dtype=BF16)  # AMP001
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()


def train_list_comprehension(model, loader, optimizer):
    for tensors in loader:
        feats = [t.half() for t in tensors]  # AMP001
        model(*feats).backward()
        optimizer.step()


def train_dict_comprehension(model, loader, optimizer):
    for batch in loader:
        batch = {k: v.to(th.bfloat16) for k, v in batch.items()}  # AMP001
        model(**batch).backward()
        optimizer.step()


def train_lambda_over_batch(model, loader, optimizer, tree_map):
    for batch in loader:
        batch = tree_map(lambda t: t.half(), batch)  # AMP001
        model(batch).backward()
        optimizer.step()


def train_half_copy(model, loader):
    model16 = copy.deepcopy(model).half()  # AMP001
    optimizer = torch.optim.SGD(model16.parameters(), lr=0.1)
    for x, y in loader:
        model16(x, y).backward()
        optimizer.step()


def train_to_dtype_of_half_tensor(model, loader, optimizer, template):
    reference = template.half()  # AMP001
    for x, y in loader:
        x = x.to(reference)  # AMP001
        model(x.type_as(reference), y).backward()  # AMP001
        optimizer.step()


def train_then_save_model_state(model, loader, optimizer, path):
    model = model.half()  # AMP001
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()
    torch.save(model.state_dict(), path)


def train_moves_and_layout(model, loader, optimizer, device):
    model.to(memory_format=torch.channels_last)
    for x, y in loader:
        x = x.to(device, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.type(torch.cuda.LongTensor)
        model(x.to(torch.float32), y).backward()
        optimizer.step()


def train_to_runtime_dtype(model, loader, optimizer, weight_dtype):
    for x, y in loader:
        x = x.to(dtype=weight_dtype)
        model(x.to(model.dtype), y).backward()
        optimizer.step()


def train_matching_activation_dtype(model, mask_emb, loader, optimizer):
    for x, mask in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            h = torch.zeros(x.shape, dtype=torch.float16, device=x.device)
            h[mask] = mask_emb.to(h.dtype)
            h = h * mask.unsqueeze(-1).to(dtype=h.dtype)
            loss = model.head(h).float().mean()
        loss.backward()
        optimizer.step()


def train_and_save_half_copy(model, loader, optimizer, path):
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()
    half_model = copy.deepcopy(model).half()
    torch.save(half_model.state_dict(), path)


def train_and_save_compact_state(model, loader, optimizer, path):
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()
    torch.save({k: v.half() for k, v in model.state_dict().items()}, path)


class CheckpointingTrainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def train_step(self, x, y):
        self.model(x, y).backward()
        self.optimizer.step()

    def save_checkpoint(self, path, step):
        state = {k: v.half() for k, v in self.model.state_dict().items()}
        torch.save({"model": state, "step": step}, path)

    def average_into(self, other):
        weights = self.model.state_dict()
        other.load_state_dict({k: weights[k].half() for k in weights})


def export_comprehension(tensors):
    return [t.half() for t in tensors]


def train_lora_adapters_on_frozen_base(model, loader, optimizer, device):
    model.requires_grad_(False)
    model.to(device, dtype=torch.bfloat16)
    model.train()
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()


class TargetNetworkAgent:
    def __init__(self, q, target):
        self.q = q
        self.target = target.half().eval()
        self.optimizer = torch.optim.Adam(q.parameters())

    def sync_target(self):
        self.target.load_state_dict({k: v.half() for k, v in self.q.state_dict().items()})

    def train_step(self, x, y):
        self.q(x, y).backward()
        self.optimizer.step()


class HalfFitTrainer:
    def __init__(self, model):
        self.model = model

    def fit(self, loader, optimizer):
        self.model = self.model.half()  # AMP001
        for x, y in loader:
            self.model(x, y).backward()
            optimizer.step()

    def evaluate(self, loader):
        self.model.eval()
        return [self.model(x) for x, _ in loader]


def pad_to_best_fit(images, size):
    return images


def resize_for_the_processor(images, size):
    images = pad_to_best_fit(images, size)
    return images.to(dtype=torch.bfloat16)


def step_with_lambda(model, batch, optimizer, tree_map):
    batch = tree_map(lambda t: t.half(), batch)  # AMP001
    model(batch).backward()
    optimizer.step()


class LambdaSelfTrainer:
    def step(self, batch, optimizer):
        outputs = list(map(lambda x: self.model(x.half()), batch))  # AMP001
        sum(o.sum() for o in outputs).backward()
        optimizer.step()


# ---- found in public projects: casts that are not training in low precision -------
def check_optimizer_state_after_step(model, optimizer, reference, assert_close):
    model(torch.ones(4, 4)).sum().backward()
    optimizer.step()
    assert_close(optimizer.state[model.weight]["exp_avg"].half(), reference)
    assert torch.equal(model.weight.grad.half(), reference)


def train_then_validate_best(model, loader, optimizer, validate, attempt_load, best):
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()
    return validate.run(model=attempt_load(best).half(), dataloader=loader)


class PipelineEngine:
    """A pipeline-parallel engine: ``train_batch`` trains, the other methods move tensors."""

    def __init__(self, module, optimizer):
        self.module = module
        self.optimizer = optimizer

    def train_batch(self, batch):
        self.module(batch).backward()
        self.optimizer.step()

    def send_activations(self, outputs, send):
        # the bool mask travels with the fp16 activations
        outputs = list(outputs)
        outputs[-1] = outputs[-1].half()
        send(tuple(outputs))


class HalfModelTrainer:
    """A model kept on ``self`` is judged by the class that trains it."""

    def __init__(self, model, optimizer):
        self.model = model.half()  # AMP001
        self.optimizer = optimizer

    def train_step(self, x, y):
        self.model(x, y).backward()
        self.optimizer.step()


# ---- a cast then stepped by an optimizer built after it in the same function ------------
def build_model_and_optimizer(model, weight_decay):
    model.half()  # AMP001
    no_decay = ("bias", "LayerNorm.weight")
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)]},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)]},
    ]
    return model, torch.optim.AdamW(grouped, lr=1e-4, weight_decay=weight_decay)


def build_bound_half_model(Net):
    model = Net().cuda().half()  # AMP001
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def setup_trainable_embeddings(text_encoder, device):
    text_encoder.to(device, dtype=torch.float16)  # AMP001
    params = filter(lambda p: p.requires_grad, text_encoder.get_input_embeddings().parameters())
    return torch.optim.AdamW(params, lr=5e-4)


def setup_half_head(model):
    model.half()  # AMP001
    return torch.optim.Adam(model.head.parameters())


def build_with_cast_undone(model):
    model.half()
    model.float()
    return torch.optim.AdamW(model.parameters())


def build_beside_an_export_copy(model, path):
    exported = copy.deepcopy(model).half()
    optimizer = torch.optim.AdamW(model.parameters())
    return exported, optimizer


def build_student_beside_half_teacher(teacher, student):
    teacher.half()
    return torch.optim.AdamW(student.parameters())


def build_optimizer_then_compact(model, path):
    optimizer = torch.optim.AdamW(model.parameters())
    model.half()
    return optimizer


def build_with_fp32_master_weights(model, FP16_Optimizer):
    model.half()
    return FP16_Optimizer(torch.optim.Adam(model.parameters()), dynamic_loss_scale=True)


def build_with_fp32_master_copies(model):
    model.half()
    master = [p.detach().clone().float() for p in model.parameters()]
    return torch.optim.AdamW(master)


def build_adapters_on_frozen_half_base(model, inject_lora):
    model.requires_grad_(False)
    model.half()
    model = inject_lora(model)
    return torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()))


def build_with_fp16_flag(model, args):
    if args.fp16:
        model.half()
    return torch.optim.AdamW(model.parameters())


# ---- a value a helper returns is judged where its caller receives it ------------------


def build_half_model(make_net, device):
    model = make_net().to(device)
    model.half()  # AMP001
    return model


def train_built_model(make_net, loader, device):
    model = build_half_model(make_net, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()


def prepare_batch(batch, device):
    images = batch["image"].to(device, non_blocking=True).half()  # AMP001
    return images, batch["label"].to(device)


def prepare_features(batch):
    return {key: value.to(torch.float16) for key, value in batch.items()}  # AMP001


def fit_prepared(model, loader, optimizer, device):
    for batch in loader:
        images, labels = prepare_batch(batch, device)
        extra = prepare_features(batch)
        loss = model(images, labels, **extra)
        loss.backward()
        optimizer.step()


def half_inputs_for_eval(batch):
    return batch["image"].cuda().half()


def evaluate_helper_inputs(model, loader):
    for batch in loader:
        model(half_inputs_for_eval(batch))


def half_inputs_under_no_grad(batch):
    return batch["image"].cuda().half()


def train_with_monitoring(model, loader, optimizer, monitor):
    for batch in loader:
        model(batch["image"], batch["label"]).backward()
        optimizer.step()
        with torch.no_grad():
            monitor(model, half_inputs_under_no_grad(batch))


def half_copy_for_predict(model):
    model_copy = copy.deepcopy(model)
    model_copy.half()
    return model_copy


def train_then_predict(model, loader, optimizer, predict):
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()
    predict(half_copy_for_predict(model), loader)


def half_numpy_batch(batch):
    return np.asarray(batch).astype(np.float16)


def train_numpy_batches(model, loader, optimizer):
    for batch in loader:
        model(torch.from_numpy(half_numpy_batch(batch))).backward()
        optimizer.step()


def unused_half_helper(x):
    return x.half()


class DistilledClassifier(torch.nn.Module):
    def __init__(self, vectors, teacher):
        super().__init__()
        self.embedding = torch.nn.Embedding.from_pretrained(vectors, freeze=False).half()  # AMP001
        self.teacher = teacher.half().eval()
        self.head = torch.nn.Linear(300, 2)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        with torch.no_grad():
            soft = self.teacher(tokens)
        return self.head(self.embedding(tokens).float()).sub(soft).pow(2).mean()


class FrozenTeacherStudent(torch.nn.Module):
    def __init__(self, student, teacher):
        super().__init__()
        self.student = student
        self.teacher = teacher.half().eval()

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            soft = self.teacher(batch)
        return (self.student(batch) - soft).pow(2).mean()


def build_lora_or_full(cfg, make_model, wrap_lora):
    model = make_model(cfg)
    if cfg.lora:
        model.requires_grad_(False)
        model = wrap_lora(model)
        return model
    return model.to(dtype=torch.bfloat16)  # AMP001


def train_built_lora_or_full(cfg, make_model, wrap_lora, loader):
    model = build_lora_or_full(cfg, make_model, wrap_lora).cuda()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for batch in loader:
        model(batch).backward()
        optimizer.step()


def build_frozen_half_base(cfg, make_model, wrap_lora):
    model = make_model(cfg)
    if cfg.lora:
        model.requires_grad_(False)
        model.half()
        return wrap_lora(model)
    return model


def train_built_frozen_base(cfg, make_model, wrap_lora, loader):
    model = build_frozen_half_base(cfg, make_model, wrap_lora).cuda()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for batch in loader:
        model(batch).backward()
        optimizer.step()


def train_flag_switches_amp_too(args, model, loader, optimizer):
    if args.fp16:
        model = model.half()  # AMP001
    grad_scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            loss = model(x, y)
        grad_scaler.scale(loss).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()


def train_pure_fp16_flag_own_scaling(args, model, loader, optimizer):
    if args.pure_fp16:
        model = model.half()
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            loss = model(x, y)
        (loss * args.static_loss_scale).backward()
        optimizer.step()


# ---- models frozen in a loop over a tuple of them ---------------------------------------
def distill_video(args, loader, teacher_unet, student_unet, vae, image_encoder):
    weight_dtype = torch.float16
    for frozen in (vae, image_encoder, teacher_unet):
        frozen.requires_grad_(False)
        frozen.eval()
    for module in [vae, image_encoder]:
        for p in module.parameters():
            p.requires_grad = False
    vae.to("cuda", dtype=weight_dtype)
    image_encoder.to("cuda", dtype=weight_dtype)
    teacher_unet.to("cuda", dtype=weight_dtype)
    student_unet.half()  # AMP001
    optimizer = torch.optim.AdamW(student_unet.parameters(), lr=1e-5, eps=1e-6)
    for batch in loader:
        student_unet(batch).mean().backward()
        optimizer.step()


# ---- a deepcopy cast to fp16 whose submodule is then trained ------------------------------
def warm_start_actor(agent, demos, lr=1e-3):
    bc_policy = copy.deepcopy(agent).half()  # AMP001
    optimizer = torch.optim.SGD(bc_policy.actor.parameters(), lr=lr, momentum=0.9)
    for obs, actions in demos:
        loss = torch.nn.functional.cross_entropy(bc_policy.actor(obs).float(), actions)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    agent.actor.load_state_dict(bc_policy.actor.float().state_dict())


def export_actor(agent, path):
    exported = copy.deepcopy(agent).half()
    torch.save(exported.actor.state_dict(), path)


# ---- a frozen model handed to the training function along with the one it trains ----------
def train_control_branch(unet, controlnet, optimizer, loader):
    for batch in loader:
        controlnet(batch).float().mean().backward()
        optimizer.step()


def main_control(unet, controlnet, loader):
    unet.requires_grad_(False)
    unet.to("cuda", dtype=torch.bfloat16)
    controlnet = controlnet.to("cuda", dtype=torch.bfloat16)  # AMP001
    optimizer = torch.optim.AdamW(controlnet.parameters(), lr=1e-5)
    train_control_branch(unet, controlnet, optimizer, loader)


# A trainer's helper that packs stop flags for a collective returns booleans, not the cast.
class StopFlagTrainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.bad_epochs = model, optimizer, 0

    def fit(self, loader, epochs):
        for _ in range(epochs):
            for x, y in loader:
                loss = self.model(x, y)
                loss.backward()
                self.optimizer.step()
            stop = torch.tensor([float(self.bad_epochs >= 3)])
            if self._agree(stop).item():
                break

    def _agree(self, flags):
        packed = flags.to(torch.float16)
        torch.distributed.all_reduce(packed)
        return packed > 0

    def _batch(self, x):
        return x.to(torch.float16)  # AMP001

    def fit_on_batches(self, loader):
        for x, y in loader:
            loss = self.model(self._batch(x), y)
            loss.backward()
            self.optimizer.step()


# A local value of a method nothing trains with is not judged by the class's name.
class HistogramTrainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def train_epoch(self, loader):
        for x, y in loader:
            loss = self.model(x, y)
            loss.backward()
            self.optimizer.step()

    def activation_histogram(self, values):
        compact = values.to(torch.float16)
        return torch.histc(compact.float(), bins=10)


# A model loaded in low precision and then optimized whole trains like a cast one.
def finetune_loaded_in_fp16(args, loader):
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float16).cuda()  # AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-6)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def finetune_loaded_in_bf16_new_keyword(name, loader):
    model = AutoModelForSequenceClassification.from_pretrained(name, dtype=th.bfloat16)  # AMP001
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0},
    ], lr=2e-5)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()


def qlora_base_loaded_in_fp16(args, loader, lora_config):
    model = AutoModelForCausalLM.from_pretrained(
        args.model, torch_dtype=torch.float16, quantization_config=args.bnb)
    model = prepare_model_for_kbit_training(model)
    model = get_peft_model(model, lora_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()


def adapters_by_hand_on_a_half_base(args, loader):
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float16)
    for param in model.parameters():
        param.requires_grad = False
    add_adapters(model, rank=8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()


def half_teacher_fp32_student(args, student, loader):
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, torch_dtype=torch.float16).eval()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    for batch in loader:
        with torch.no_grad():
            target = teacher(**batch).logits
        loss = torch.nn.functional.mse_loss(student(**batch).logits.float(), target.float())
        loss.backward()
        optimizer.step()


def loader_dtype_behind_a_precision_flag(args, loader):
    dtype = torch.float16 if args.fp16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()


def generate_with_a_bf16_model(name, prompts):
    model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16).cuda().eval()
    return [model.generate(**p) for p in prompts]


def lora_by_name_on_a_base_loaded_in_bf16(args, loader):
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.requires_grad_(False)
    inject_lora(model, r=args.lora_r)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()


# A helper's cast scaled by a number is still what it hands back to training.
def preprocess_in_half(batch, device):
    imgs = batch["img"].to(device, non_blocking=True, dtype=torch.float16) / 255.0  # AMP001
    return imgs, batch["targets"].to(device)


def train_on_preprocessed(model, loader, optimizer, device):
    for batch in loader:
        imgs, targets = preprocess_in_half(batch, device)
        model(imgs, targets).backward()
        optimizer.step()


def preprocess_for_eval(batch, device):
    imgs = batch["img"].to(device, dtype=torch.float16) / 255.0
    return imgs


@torch.no_grad()
def evaluate_preprocessed(model, loader, device):
    return [model(preprocess_for_eval(batch, device)).argmax(-1) for batch in loader]
