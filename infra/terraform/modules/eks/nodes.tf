# Two managed node groups: CPU for the stateless tiers, GPU (H100) for engines. GPU nodes are tainted so nothing
# but GPU workloads is scheduled onto them.

locals {
  gpu_labels = {
    "mplex.ai/pool"          = "gpu"
    "nvidia.com/gpu.present" = "true"
  }
  cpu_labels = {
    "mplex.ai/pool" = "cpu"
  }
}

data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name               = "${var.name}-node"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset([
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
    "AmazonSSMManagedInstanceCore", # shell access through Session Manager instead of SSH keys
  ])
  role       = aws_iam_role.node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/${each.value}"
}

resource "aws_launch_template" "cpu" {
  name_prefix            = "${var.name}-cpu-"
  update_default_version = true

  # IMDSv2 only, one hop: pods cannot borrow the node's role, they use their own (IRSA).
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = var.cpu_node_group.disk_size_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(local.tags, { Name = "${var.name}-cpu" })
  }

  tags = local.tags
}

resource "aws_launch_template" "gpu" {
  name_prefix            = "${var.name}-gpu-"
  update_default_version = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = var.gpu_node_group.disk_size_gb
      volume_type           = "gp3"
      iops                  = 6000
      throughput            = 500 # image pulls of the multi-GB CUDA image dominate node start-up
      encrypted             = true
      delete_on_termination = true
    }
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(local.tags, { Name = "${var.name}-gpu" })
  }

  tags = local.tags
}

resource "aws_eks_node_group" "cpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "cpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.private_subnet_ids
  ami_type        = "AL2023_x86_64_STANDARD"
  capacity_type   = "ON_DEMAND"
  instance_types  = var.cpu_node_group.instance_types
  labels          = local.cpu_labels

  launch_template {
    id      = aws_launch_template.cpu.id
    version = aws_launch_template.cpu.latest_version
  }

  scaling_config {
    min_size     = var.cpu_node_group.min_size
    max_size     = var.cpu_node_group.max_size
    desired_size = var.cpu_node_group.desired_size
  }

  update_config {
    max_unavailable_percentage = 33
  }

  tags = local.tags

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size] # the cluster autoscaler owns it after creation
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

resource "aws_eks_node_group" "gpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "gpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.private_subnet_ids
  ami_type        = "AL2023_x86_64_NVIDIA" # NVIDIA driver and container toolkit preinstalled
  capacity_type   = var.gpu_node_group.capacity_type
  instance_types  = var.gpu_node_group.instance_types
  labels          = local.gpu_labels

  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  launch_template {
    id      = aws_launch_template.gpu.id
    version = aws_launch_template.gpu.latest_version
  }

  scaling_config {
    min_size     = var.gpu_node_group.min_size
    max_size     = var.gpu_node_group.max_size
    desired_size = var.gpu_node_group.desired_size
  }

  # One GPU node at a time: each carries up to 8 engines and their in-flight streams.
  update_config {
    max_unavailable = 1
  }

  tags = local.tags

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

# Scale-from-zero: the cluster autoscaler learns what an empty GPU group would offer from these ASG tags
# (managed node group tags do not reach the underlying ASG).
locals {
  gpu_asg_template_tags = merge(
    { for k, v in local.gpu_labels : "k8s.io/cluster-autoscaler/node-template/label/${k}" => v },
    {
      "k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu"     = "true:NoSchedule"
      "k8s.io/cluster-autoscaler/node-template/resources/nvidia.com/gpu" = tostring(var.gpu_node_group.gpus_per_node)
    },
  )
}

resource "aws_autoscaling_group_tag" "gpu_template" {
  for_each               = local.gpu_asg_template_tags
  autoscaling_group_name = aws_eks_node_group.gpu.resources[0].autoscaling_groups[0].name

  tag {
    key                 = each.key
    value               = each.value
    propagate_at_launch = false
  }
}
