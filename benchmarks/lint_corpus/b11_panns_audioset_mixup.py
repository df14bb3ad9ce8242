"""PANNs Cnn14 on our in-house sound-event set (AudioSet-style multi-label, 380 classes) +
transfer to ESC-50.  Based on qiuqiangkong/audioset_tagging_cnn (pytorch/main.py, models.py,
losses.py, pytorch_utils.py) with the torchlibrosa front end re-implemented inline
(torchlibrosa's Spectrogram did not export to onnx for us).

    python main.py train --workspace ws --data_h5 ws/hdf5s/train.h5 --batch_size 32 --amp --mixup
    python main.py finetune_esc50 --pretrained ws/ckpt/Cnn14_best.pth --fold 1 --amp
"""
import argparse
import logging
import os
import time

import h5py
import librosa
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn import metrics
from torch.cuda import amp
from torch.utils.data import DataLoader, Dataset

SAMPLE_RATE = 32000
WINDOW_SIZE = 1024
HOP_SIZE = 320
MEL_BINS = 64
FMIN, FMAX = 50, 14000
CLASSES_NUM = 380


# ----------------------------------------------------------------------------------------
# pytorch_utils.py
# ----------------------------------------------------------------------------------------
def move_data_to_device(x, device):
    if 'float' in str(x.dtype):
        x = torch.Tensor(x)
    elif 'int' in str(x.dtype):
        x = torch.LongTensor(x)
    else:
        return x
    return x.to(device)


def do_mixup(x, mixup_lambda):
    """Mixup x of even indexes (0, 2, 4, ...) with x of odd indexes (1, 3, 5, ...).
    x: (batch_size * 2, ...), mixup_lambda: (batch_size * 2,)"""
    out = (x[0::2].transpose(0, -1) * mixup_lambda[0::2] +
           x[1::2].transpose(0, -1) * mixup_lambda[1::2]).transpose(0, -1)
    return out


class Mixup(object):
    def __init__(self, mixup_alpha, random_seed=1234):
        self.mixup_alpha = mixup_alpha
        self.random_state = np.random.RandomState(random_seed)

    def get_lambda(self, batch_size):
        mixup_lambdas = []
        for n in range(0, batch_size, 2):
            lam = self.random_state.beta(self.mixup_alpha, self.mixup_alpha, 1)[0]
            mixup_lambdas.append(lam)
            mixup_lambdas.append(1. - lam)
        return np.array(mixup_lambdas)


def init_layer(layer):
    nn.init.xavier_uniform_(layer.weight)
    if hasattr(layer, 'bias'):
        if layer.bias is not None:
            layer.bias.data.fill_(0.)


def init_bn(bn):
    bn.bias.data.fill_(0.)
    bn.weight.data.fill_(1.)


# ----------------------------------------------------------------------------------------
# front end (replaces torchlibrosa.stft.Spectrogram + LogmelFilterBank)
# ----------------------------------------------------------------------------------------
class LogMelFrontEnd(nn.Module):
    def __init__(self, sr=SAMPLE_RATE, n_fft=WINDOW_SIZE, hop=HOP_SIZE, n_mels=MEL_BINS, fmin=FMIN, fmax=FMAX):
        super().__init__()
        self.n_fft = n_fft
        self.hop = hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        melW = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax).T
        self.register_buffer("melW", torch.from_numpy(melW).float(), persistent=False)

    def forward(self, waveform):
        # waveform: (B, samples) -> (B, 1, T, mel)
        spec = torch.stft(waveform, self.n_fft, hop_length=self.hop, window=self.window,
                          center=True, pad_mode="reflect", return_complex=True)
        power = spec.abs() ** 2                       # (B, F, T)
        mel = torch.matmul(power.transpose(1, 2), self.melW)   # (B, T, mel)
        logmel = 10.0 * torch.log10(mel + 1e-10)  # expect: AMP011
        return logmel[:, None, :, :]


class DropStripes(nn.Module):
    def __init__(self, dim, drop_width, stripes_num):
        super().__init__()
        assert dim in [2, 3]
        self.dim = dim
        self.drop_width = drop_width
        self.stripes_num = stripes_num

    def forward(self, input):
        if self.training is False:
            return input
        batch_size = input.shape[0]
        total_width = input.shape[self.dim]
        for n in range(batch_size):
            for _ in range(self.stripes_num):
                distance = torch.randint(low=0, high=self.drop_width, size=(1,))[0]
                bgn = torch.randint(low=0, high=total_width - distance, size=(1,))[0]
                if self.dim == 2:
                    input[n, :, bgn: bgn + distance, :] = 0
                elif self.dim == 3:
                    input[n, :, :, bgn: bgn + distance] = 0
        return input


class SpecAugmentation(nn.Module):
    def __init__(self, time_drop_width, time_stripes_num, freq_drop_width, freq_stripes_num):
        super().__init__()
        self.time_dropper = DropStripes(dim=2, drop_width=time_drop_width, stripes_num=time_stripes_num)
        self.freq_dropper = DropStripes(dim=3, drop_width=freq_drop_width, stripes_num=freq_stripes_num)

    def forward(self, input):
        x = self.time_dropper(input)
        x = self.freq_dropper(x)
        return x


# ----------------------------------------------------------------------------------------
# models.py
# ----------------------------------------------------------------------------------------
class ConvBlock(nn.Module):
    def __init__(self, in_channels, out_channels):
        super(ConvBlock, self).__init__()
        self.conv1 = nn.Conv2d(in_channels=in_channels, out_channels=out_channels, kernel_size=(3, 3),
                               stride=(1, 1), padding=(1, 1), bias=False)
        self.conv2 = nn.Conv2d(in_channels=out_channels, out_channels=out_channels, kernel_size=(3, 3),
                               stride=(1, 1), padding=(1, 1), bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.init_weight()

    def init_weight(self):
        init_layer(self.conv1)
        init_layer(self.conv2)
        init_bn(self.bn1)
        init_bn(self.bn2)

    def forward(self, input, pool_size=(2, 2), pool_type='avg'):
        x = input
        x = F.relu_(self.bn1(self.conv1(x)))
        x = F.relu_(self.bn2(self.conv2(x)))
        if pool_type == 'max':
            x = F.max_pool2d(x, kernel_size=pool_size)
        elif pool_type == 'avg':
            x = F.avg_pool2d(x, kernel_size=pool_size)
        elif pool_type == 'avg+max':
            x1 = F.avg_pool2d(x, kernel_size=pool_size)
            x2 = F.max_pool2d(x, kernel_size=pool_size)
            x = x1 + x2
        else:
            raise Exception('Incorrect argument!')
        return x


class Cnn14(nn.Module):
    def __init__(self, classes_num=CLASSES_NUM):
        super(Cnn14, self).__init__()
        self.logmel_extractor = LogMelFrontEnd()
        self.spec_augmenter = SpecAugmentation(time_drop_width=64, time_stripes_num=2,
                                               freq_drop_width=8, freq_stripes_num=2)
        self.bn0 = nn.BatchNorm2d(64)
        self.conv_block1 = ConvBlock(in_channels=1, out_channels=64)
        self.conv_block2 = ConvBlock(in_channels=64, out_channels=128)
        self.conv_block3 = ConvBlock(in_channels=128, out_channels=256)
        self.conv_block4 = ConvBlock(in_channels=256, out_channels=512)
        self.conv_block5 = ConvBlock(in_channels=512, out_channels=1024)
        self.conv_block6 = ConvBlock(in_channels=1024, out_channels=2048)
        self.fc1 = nn.Linear(2048, 2048, bias=True)
        self.fc_audioset = nn.Linear(2048, classes_num, bias=True)
        self.init_weight()

    def init_weight(self):
        init_bn(self.bn0)
        init_layer(self.fc1)
        init_layer(self.fc_audioset)

    def forward(self, input, mixup_lambda=None):
        """input: (batch_size, data_length)"""
        x = self.logmel_extractor(input)    # (batch_size, 1, time_steps, mel_bins)

        x = x.transpose(1, 3)
        x = self.bn0(x)
        x = x.transpose(1, 3)

        if self.training:
            x = self.spec_augmenter(x)

        # Mixup on spectrogram
        if self.training and mixup_lambda is not None:
            x = do_mixup(x, mixup_lambda)

        x = self.conv_block1(x, pool_size=(2, 2), pool_type='avg')
        x = F.dropout(x, p=0.2, training=self.training)
        x = self.conv_block2(x, pool_size=(2, 2), pool_type='avg')
        x = F.dropout(x, p=0.2, training=self.training)
        x = self.conv_block3(x, pool_size=(2, 2), pool_type='avg')
        x = F.dropout(x, p=0.2, training=self.training)
        x = self.conv_block4(x, pool_size=(2, 2), pool_type='avg')
        x = F.dropout(x, p=0.2, training=self.training)
        x = self.conv_block5(x, pool_size=(2, 2), pool_type='avg')
        x = F.dropout(x, p=0.2, training=self.training)
        x = self.conv_block6(x, pool_size=(1, 1), pool_type='avg')
        x = F.dropout(x, p=0.2, training=self.training)
        x = torch.mean(x, dim=3)  # expect: AMP004

        (x1, _) = torch.max(x, dim=2)
        x2 = torch.mean(x, dim=2)  # expect: AMP004
        x = x1 + x2
        x = F.dropout(x, p=0.5, training=self.training)
        x = F.relu_(self.fc1(x))
        embedding = F.dropout(x, p=0.5, training=self.training)
        clipwise_output = torch.sigmoid(self.fc_audioset(x))

        output_dict = {'clipwise_output': clipwise_output, 'embedding': embedding}
        return output_dict


class Transfer_Cnn14(nn.Module):
    def __init__(self, classes_num, freeze_base):
        super(Transfer_Cnn14, self).__init__()
        self.base = Cnn14(classes_num=CLASSES_NUM)
        self.fc_transfer = nn.Linear(2048, classes_num, bias=True)
        if freeze_base:
            for param in self.base.parameters():
                param.requires_grad = False
        init_layer(self.fc_transfer)

    def load_from_pretrain(self, pretrained_checkpoint_path):
        checkpoint = torch.load(pretrained_checkpoint_path, map_location="cpu")
        self.base.load_state_dict(checkpoint['model'])

    def forward(self, input, mixup_lambda=None):
        output_dict = self.base(input, mixup_lambda)
        embedding = output_dict['embedding']
        clipwise_output = torch.log_softmax(self.fc_transfer(embedding), dim=-1)
        output_dict['clipwise_output'] = clipwise_output
        return output_dict


# ----------------------------------------------------------------------------------------
# losses.py
# ----------------------------------------------------------------------------------------
def clip_bce(output_dict, target_dict):
    """Binary crossentropy loss."""
    return F.binary_cross_entropy(output_dict['clipwise_output'], target_dict['target'])  # expect: AMP003


def clip_nll(output_dict, target_dict):
    loss = - torch.mean(target_dict['target'] * output_dict['clipwise_output'])
    return loss


def get_loss_func(loss_type):
    if loss_type == 'clip_bce':
        return clip_bce
    if loss_type == 'clip_nll':
        return clip_nll


# ----------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------
class H5Dataset(Dataset):
    def __init__(self, h5_path, clip_samples=SAMPLE_RATE * 10):
        self.h5_path = h5_path
        self.clip_samples = clip_samples
        with h5py.File(h5_path, 'r') as hf:
            self.n = len(hf['audio_name'])
        self.hf = None

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        if self.hf is None:
            self.hf = h5py.File(self.h5_path, 'r')
        waveform = self.hf['waveform'][idx].astype(np.float32) / 32767.
        target = self.hf['target'][idx].astype(np.float32)
        return {'waveform': waveform, 'target': target}


def collate_fn(list_data_dict):
    np_data_dict = {}
    for key in list_data_dict[0].keys():
        np_data_dict[key] = np.array([data_dict[key] for data_dict in list_data_dict])
    return np_data_dict


# ----------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, args, model, train_loader, eval_loader, device):
        self.args = args
        self.device = device
        self.model = model.to(device)
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.optimizer = optim.Adam(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.999),
                                    eps=1e-08, weight_decay=0., amsgrad=True)
        self.scaler = amp.GradScaler(enabled=args.amp)  # expect: AMP009
        self.mixup_augmenter = Mixup(mixup_alpha=1.) if args.mixup else None
        self.iteration = 0

    def train_step(self, batch_data_dict):
        waveform = move_data_to_device(batch_data_dict['waveform'], self.device)
        target = move_data_to_device(batch_data_dict['target'], self.device)
        if self.mixup_augmenter is not None:
            mixup_lambda = move_data_to_device(self.mixup_augmenter.get_lambda(len(waveform)), self.device)
        else:
            mixup_lambda = None

        self.model.train()
        with amp.autocast(enabled=self.args.amp):  # expect: AMP009
            batch_output_dict = self.model(waveform, mixup_lambda)
            if mixup_lambda is not None:
                target = do_mixup(target, mixup_lambda)
            loss = clip_bce(batch_output_dict, {'target': target})

        loss = self.scaler.scale(loss)
        loss.backward()
        self.optimizer.step()  # expect: AMP006
        self.optimizer.zero_grad()
        self.iteration += 1
        return loss.item() / self.scaler.get_scale()

    def evaluate(self):
        self.model.eval()
        clipwise, targets = [], []
        eval_loss = 0.0
        for batch in self.eval_loader:
            waveform = move_data_to_device(batch['waveform'], self.device)
            target = move_data_to_device(batch['target'], self.device)
            with torch.no_grad():
                out = self.model(waveform)
                eval_loss += F.binary_cross_entropy(out['clipwise_output'].float(), target).item()
            clipwise.append(out['clipwise_output'].cpu().numpy())
            targets.append(batch['target'])
        clipwise = np.concatenate(clipwise)
        targets = np.concatenate(targets)
        average_precision = metrics.average_precision_score(targets, clipwise, average=None)
        auc = metrics.roc_auc_score(targets, clipwise, average=None)
        return {'mAP': np.mean(average_precision), 'auc': np.mean(auc),
                'loss': eval_loss / max(1, len(self.eval_loader))}

    def train(self):
        best_map = 0.0
        t0 = time.time()
        for batch_data_dict in self.train_loader:
            if self.iteration % 2000 == 0 and self.iteration > 0:
                stats = self.evaluate()
                logging.info('iter {} mAP {:.4f} auc {:.4f} ({:.0f}s)'.format(
                    self.iteration, stats['mAP'], stats['auc'], time.time() - t0))
                if stats['mAP'] > best_map:
                    best_map = stats['mAP']
                    torch.save({'iteration': self.iteration, 'model': self.model.state_dict()},
                               os.path.join(self.args.workspace, 'ckpt', 'Cnn14_best.pth'))
            loss = self.train_step(batch_data_dict)
            if self.iteration % 100 == 0:
                logging.info('iter {} loss {:.5f}'.format(self.iteration, loss))
            if self.iteration == self.args.early_stop:
                break


def train(args):
    device = torch.device('cuda') if torch.cuda.is_available() else torch.device('cpu')
    os.makedirs(os.path.join(args.workspace, 'ckpt'), exist_ok=True)
    train_loader = DataLoader(H5Dataset(args.data_h5), batch_size=args.batch_size * 2 if args.mixup else args.batch_size,
                              shuffle=True, collate_fn=collate_fn, num_workers=8, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(H5Dataset(args.eval_h5), batch_size=args.batch_size, shuffle=False,
                             collate_fn=collate_fn, num_workers=8, pin_memory=True)
    model = Cnn14(classes_num=CLASSES_NUM)
    if 'cuda' in str(device):
        model = torch.nn.DataParallel(model)
    trainer = Trainer(args, model, train_loader, eval_loader, device)
    trainer.train()


def finetune_esc50(args):
    """5-fold ESC-50 transfer from our Cnn14 checkpoint"""
    device = torch.device('cuda')
    model = Transfer_Cnn14(classes_num=50, freeze_base=args.freeze_base)
    model.load_from_pretrain(args.pretrained)
    model.to(device)
    optimizer = optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-4)
    data = np.load(os.path.join(args.workspace, 'esc50_32k.npz'))
    train_idx = data['fold'] != args.fold
    xs = torch.from_numpy(data['waveform'][train_idx]).float()
    ys = torch.from_numpy(data['label'][train_idx]).long()
    n = len(xs)
    for epoch in range(args.ft_epochs):
        model.train()
        perm = torch.randperm(n)
        for i in range(0, n, args.batch_size):
            idx = perm[i:i + args.batch_size]
            x = xs[idx].to(device, non_blocking=True)
            y = ys[idx].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):  # expect: AMP010
                output_dict = model(x)
                loss = F.nll_loss(output_dict['clipwise_output'], y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        logging.info(f'ft epoch {epoch} loss {loss.item():.4f}')
    torch.save(model.state_dict(), os.path.join(args.workspace, 'ckpt', f'esc50_fold{args.fold}.pth'))


if __name__ == '__main__':
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(description='PANNs on in-house data')
    subparsers = parser.add_subparsers(dest='mode')

    parser_train = subparsers.add_parser('train')
    parser_train.add_argument('--workspace', type=str, required=True)
    parser_train.add_argument('--data_h5', type=str, required=True)
    parser_train.add_argument('--eval_h5', type=str, default='ws/hdf5s/eval.h5')
    parser_train.add_argument('--batch_size', type=int, default=32)
    parser_train.add_argument('--learning_rate', type=float, default=1e-3)
    parser_train.add_argument('--early_stop', type=int, default=600000)
    parser_train.add_argument('--mixup', action='store_true', default=False)
    parser_train.add_argument('--amp', action='store_true', default=False)

    parser_ft = subparsers.add_parser('finetune_esc50')
    parser_ft.add_argument('--workspace', type=str, default='ws')
    parser_ft.add_argument('--pretrained', type=str, required=True)
    parser_ft.add_argument('--fold', type=int, default=1)
    parser_ft.add_argument('--batch_size', type=int, default=32)
    parser_ft.add_argument('--ft_epochs', type=int, default=30)
    parser_ft.add_argument('--freeze_base', action='store_true', default=False)
    parser_ft.add_argument('--amp', action='store_true', default=False)

    args = parser.parse_args()
    if args.mode == 'train':
        train(args)
    elif args.mode == 'finetune_esc50':
        finetune_esc50(args)
    else:
        raise Exception('Error argument!')
