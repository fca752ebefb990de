"""The models psserver ships: the classic MNIST CNN, a small MLP, ResNet-18 for 32x32."""

from __future__ import annotations

from torch import nn

from psserver.models.registry import ModelSpec, check_spec


def mnist_cnn() -> nn.Sequential:
    """The network of PyTorch's MNIST example (conv 32, conv 64, dropout, fc 9216x128, fc 10)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, 1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, 1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(1),
        nn.Linear(9216, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, 10),
    )


def mlp() -> nn.Sequential:
    """A small MLP for 28x28 input: fast enough for smoke tests and demos."""
    return nn.Sequential(
        nn.Flatten(1),
        nn.Linear(784, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def mlp_wide() -> nn.Sequential:
    """Many parameters for little compute (1.9M, a 1024x1024 layer among them): a step's time
    goes to moving parameters and gradients, which is what bandwidth benchmarks measure."""
    return nn.Sequential(
        nn.Flatten(1),
        nn.Linear(784, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def resnet18() -> nn.Sequential:
    """torchvision's ResNet-18 adapted to 3x32x32 (3x3 stem, no max-pool), as a Sequential."""
    from torchvision.models import resnet18 as tv_resnet18

    return _small_image_resnet(tv_resnet18(num_classes=10))


def resnet50() -> nn.Sequential:
    """torchvision's ResNet-50 adapted to 3x32x32 as :func:`resnet18`: 23.5M parameters, the
    tens-of-millions model of the GPU benchmarks."""
    from torchvision.models import resnet50 as tv_resnet50

    return _small_image_resnet(tv_resnet50(num_classes=10))


def _small_image_resnet(net: nn.Module) -> nn.Sequential:
    """A torchvision ResNet with a 3x3 stem and no max-pool (32x32 inputs), as a Sequential
    (so that ``--devices`` can split it into stages)."""
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    return nn.Sequential(
        net.conv1,
        net.bn1,
        net.relu,
        net.layer1,
        net.layer2,
        net.layer3,
        net.layer4,
        net.avgpool,
        nn.Flatten(1),
        net.fc,
    )


# Registered under their names in the entry-point group psserver.models (pyproject.toml).
MNIST_CNN = check_spec(ModelSpec("mnist_cnn", mnist_cnn, (1, 28, 28), 10, "classic MNIST CNN (1.2M parameters)"))
MLP = check_spec(ModelSpec("mlp", mlp, (1, 28, 28), 10, "784-256-128-10 MLP (0.2M parameters)"))
MLP_WIDE = check_spec(ModelSpec("mlp_wide", mlp_wide, (1, 28, 28), 10,
                                "784-1024-1024-10 MLP (1.9M parameters, little compute: bandwidth benchmarks)"))
RESNET18 = check_spec(ModelSpec("resnet18", resnet18, (3, 32, 32), 10,
                                "torchvision ResNet-18 for 3x32x32 (11M parameters)"))
RESNET50 = check_spec(ModelSpec("resnet50", resnet50, (3, 32, 32), 10,
                                "torchvision ResNet-50 for 3x32x32 (23.5M parameters)"))
