//! Checks every package, service, method, message, field number and type of the compiled protos
//! against kubelet's upstream layout (reference: dra-api.md section 8), so a typo in a `.proto`
//! file cannot silently change the wire format or a gRPC method path.

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, FileDescriptorProto, FileDescriptorSet};

fn descriptor_set() -> FileDescriptorSet {
    FileDescriptorSet::decode(tessera_proto::FILE_DESCRIPTOR_SET).expect("embedded set decodes")
}

fn file(name: &str) -> FileDescriptorProto {
    descriptor_set()
        .file
        .into_iter()
        .find(|f| f.name() == name)
        .unwrap_or_else(|| panic!("{name} is not in the descriptor set"))
}

/// Renders a file as one line per service method, enum and field, e.g.
/// `Device.share_id = 5: optional string`, with type names relative to the file's package.
fn render(file: &FileDescriptorProto) -> Vec<String> {
    let prefix = format!(".{}.", file.package());
    let short = |type_name: &str| type_name.strip_prefix(&prefix).unwrap_or(type_name).to_owned();
    let mut lines = Vec::new();
    for service in &file.service {
        for method in &service.method {
            let stream = if method.server_streaming() { "stream " } else { "" };
            let client_stream = if method.client_streaming() { "stream " } else { "" };
            lines.push(format!(
                "rpc {}.{}({client_stream}{}) returns ({stream}{})",
                service.name(),
                method.name(),
                short(method.input_type()),
                short(method.output_type()),
            ));
        }
    }
    for enumeration in &file.enum_type {
        let values: Vec<String> = enumeration
            .value
            .iter()
            .map(|v| format!("{} = {}", v.name(), v.number()))
            .collect();
        lines.push(format!("enum {}: {}", enumeration.name(), values.join(", ")));
    }
    for message in &file.message_type {
        render_message(message, &short, &mut lines);
    }
    lines
}

fn render_message(message: &DescriptorProto, short: &dyn Fn(&str) -> String, lines: &mut Vec<String>) {
    let scalar = |ty: Type, type_name: &str| match ty {
        Type::String => "string".to_owned(),
        Type::Int64 => "int64".to_owned(),
        Type::Bool => "bool".to_owned(),
        Type::Message | Type::Enum => short(type_name),
        other => format!("{other:?}"),
    };
    if message.field.is_empty() {
        lines.push(format!("{} {{}}", message.name()));
    }
    for field in &message.field {
        let map_entry = message.nested_type.iter().find(|nested| {
            nested.options.as_ref().is_some_and(|o| o.map_entry())
                && field.type_name().ends_with(&format!(".{}", nested.name()))
        });
        let ty = if let Some(entry) = map_entry {
            let key = &entry.field[0];
            let value = &entry.field[1];
            assert_eq!(
                (key.name(), key.number(), value.name(), value.number()),
                ("key", 1, "value", 2)
            );
            format!(
                "map<{}, {}>",
                scalar(key.r#type(), key.type_name()),
                scalar(value.r#type(), value.type_name())
            )
        } else {
            let label = match (field.label(), field.proto3_optional()) {
                (Label::Repeated, _) => "repeated ",
                (_, true) => "optional ",
                _ => "",
            };
            format!("{label}{}", scalar(field.r#type(), field.type_name()))
        };
        lines.push(format!(
            "{}.{} = {}: {ty}",
            message.name(),
            field.name(),
            field.number()
        ));
    }
}

fn dra_lines(with_share_id: bool) -> Vec<&'static str> {
    let mut lines = vec![
        "rpc DRAPlugin.NodePrepareResources(NodePrepareResourcesRequest) returns (NodePrepareResourcesResponse)",
        "rpc DRAPlugin.NodeUnprepareResources(NodeUnprepareResourcesRequest) returns (NodeUnprepareResourcesResponse)",
        "NodePrepareResourcesRequest.claims = 1: repeated Claim",
        "NodePrepareResourcesResponse.claims = 1: map<string, NodePrepareResourceResponse>",
        "NodePrepareResourceResponse.devices = 1: repeated Device",
        "NodePrepareResourceResponse.error = 2: string",
        "Device.request_names = 1: repeated string",
        "Device.pool_name = 2: string",
        "Device.device_name = 3: string",
        "Device.cdi_device_ids = 4: repeated string",
        "Device.share_id = 5: optional string",
        "NodeUnprepareResourcesRequest.claims = 1: repeated Claim",
        "NodeUnprepareResourcesResponse.claims = 1: map<string, NodeUnprepareResourceResponse>",
        "NodeUnprepareResourceResponse.error = 1: string",
        "Claim.namespace = 1: string",
        "Claim.uid = 2: string",
        "Claim.name = 3: string",
    ];
    if !with_share_id {
        lines.retain(|line| !line.starts_with("Device.share_id"));
    }
    lines
}

fn assert_plain_proto3(file: &FileDescriptorProto, package: &str) {
    assert_eq!(file.package(), package);
    assert_eq!(file.syntax(), "proto3");
    // Upstream 1.34 files imported gogoproto; ours must import nothing.
    assert!(
        file.dependency.is_empty(),
        "{} imports {:?}",
        file.name(),
        file.dependency
    );
}

#[test]
fn dra_v1_matches_the_upstream_layout_including_share_id() {
    let file = file("k8s.io/kubelet/pkg/apis/dra/v1/api.proto");
    assert_plain_proto3(&file, "k8s.io.kubelet.pkg.apis.dra.v1");
    assert_eq!(render(&file), dra_lines(true));
}

#[test]
fn dra_v1beta1_matches_the_upstream_layout_without_share_id() {
    let file = file("k8s.io/kubelet/pkg/apis/dra/v1beta1/api.proto");
    assert_plain_proto3(&file, "k8s.io.kubelet.pkg.apis.dra.v1beta1");
    assert_eq!(render(&file), dra_lines(false));
}

#[test]
fn pluginregistration_matches_the_upstream_layout() {
    let file = file("k8s.io/kubelet/pkg/apis/pluginregistration/v1/api.proto");
    assert_plain_proto3(&file, "pluginregistration");
    let mut lines = render(&file);
    lines.sort();
    let mut expected = vec![
        "rpc Registration.GetInfo(InfoRequest) returns (PluginInfo)",
        "rpc Registration.NotifyRegistrationStatus(RegistrationStatus) returns (RegistrationStatusResponse)",
        "PluginInfo.type = 1: string",
        "PluginInfo.name = 2: string",
        "PluginInfo.endpoint = 3: string",
        "PluginInfo.supported_versions = 4: repeated string",
        "RegistrationStatus.plugin_registered = 1: bool",
        "RegistrationStatus.error = 2: string",
        "RegistrationStatusResponse {}",
        "InfoRequest {}",
    ];
    expected.sort_unstable();
    assert_eq!(lines, expected);
}

#[test]
fn dra_health_v1alpha1_matches_the_upstream_layout() {
    assert_health_layout("v1alpha1");
}

/// Kubernetes 1.37 moved the health API to `v1` with the same messages (k8s.io/kubelet v0.37.2).
#[test]
fn dra_health_v1_has_the_same_layout_in_package_v1() {
    assert_health_layout("v1");
}

fn assert_health_layout(package: &str) {
    let file = file(&format!("k8s.io/kubelet/pkg/apis/dra-health/{package}/api.proto"));
    assert_plain_proto3(&file, package);
    let mut lines = render(&file);
    lines.sort();
    let mut expected = vec![
        "rpc DRAResourceHealth.NodeWatchResources(NodeWatchResourcesRequest) returns (stream NodeWatchResourcesResponse)",
        "enum HealthStatus: UNKNOWN = 0, HEALTHY = 1, UNHEALTHY = 2",
        "NodeWatchResourcesRequest {}",
        "NodeWatchResourcesResponse.devices = 1: repeated DeviceHealth",
        "DeviceIdentifier.pool_name = 1: string",
        "DeviceIdentifier.device_name = 2: string",
        "DeviceHealth.device = 1: DeviceIdentifier",
        "DeviceHealth.health = 2: HealthStatus",
        "DeviceHealth.last_updated_time = 3: int64",
        "DeviceHealth.health_check_timeout_seconds = 4: int64",
        "DeviceHealth.message = 5: string",
    ];
    expected.sort_unstable();
    assert_eq!(lines, expected);
}

#[test]
fn the_descriptor_set_holds_exactly_the_five_vendored_files() {
    let mut names: Vec<String> = descriptor_set()
        .file
        .into_iter()
        .map(|f| f.name().to_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "k8s.io/kubelet/pkg/apis/dra-health/v1/api.proto",
            "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1/api.proto",
            "k8s.io/kubelet/pkg/apis/dra/v1/api.proto",
            "k8s.io/kubelet/pkg/apis/dra/v1beta1/api.proto",
            "k8s.io/kubelet/pkg/apis/pluginregistration/v1/api.proto",
        ]
    );
}
