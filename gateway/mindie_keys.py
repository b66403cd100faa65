"""The keys MindIE Service's config.json defines, by section (data only).

A key listed here that pardec does not use is noted once at INFO (it belongs to MindIE: TLS
files, NPU placement, scheduler tuning); a key in none of these lists is a WARNING, since it is
most likely a typo. Lists follow MindIE Service 1.x/2.x config.json and its feature pages.
"""

TOP = {"Version", "LogConfig", "ServerConfig", "BackendConfig"}

LOG_CONFIG = {"logLevel", "logFileSize", "logFileNum", "logPath"}

SERVER_CONFIG = {
    "ipAddress", "managementIpAddress", "port", "managementPort", "metricsPort",
    "allowAllZeroIpListening", "maxLinkNum", "httpsEnabled", "fullTextEnabled",
    "tlsCaPath", "tlsCaFile", "tlsCert", "tlsPk", "tlsPkPwd", "tlsCrlPath", "tlsCrlFiles",
    "managementTlsCaFile", "managementTlsCert", "managementTlsPk", "managementTlsPkPwd",
    "managementTlsCrlPath", "managementTlsCrlFiles", "kmcKsfMaster", "kmcKsfStandby",
    "inferMode", "interCommTLSEnabled", "interCommPort", "interCommTlsCaPath", "interCommTlsCaFiles",
    "interCommTlsCert", "interCommPk", "interCommPkPwd", "interCommTlsCrlPath", "interCommTlsCrlFiles",
    "openAiSupport", "tokenTimeout", "e2eTimeout", "distDPServerEnabled", "metricsTlsEnabled",
}

BACKEND_CONFIG = {
    "backendName", "modelInstanceNumber", "npuDeviceIds", "tokenizerProcessNumber",
    "multiNodesInferEnabled", "multiNodesInferPort", "interNodeTLSEnabled", "interNodeTlsCaPath",
    "interNodeTlsCaFiles", "interNodeTlsCert", "interNodeTlsPk", "interNodeTlsPkPwd",
    "interNodeTlsCrlPath", "interNodeTlsCrlFiles", "interNodeTlsCrlfiles", "interNodeKmcKsfMaster",
    "interNodeKmcKsfStandby", "ModelDeployConfig", "ScheduleConfig",
}

MODEL_DEPLOY_CONFIG = {
    "maxSeqLen", "maxInputTokenLen", "truncation", "speculationGamma", "ModelConfig", "LoraModules",
}

MODEL_CONFIG = {
    "plugin_params", "modelInstanceType", "modelName", "modelWeightPath", "worldSize", "cpuMemSize",
    "npuMemSize", "backendType", "trustRemoteCode", "async_scheduler_wait_time", "kv_trans_timeout",
    "kv_link_timeout", "multi_step", "dp", "tp", "sp", "cp", "moe_tp", "moe_ep",
}

SCHEDULE_CONFIG = {
    "templateType", "templateName", "cacheBlockSize", "maxPrefillBatchSize", "maxPrefillTokens",
    "prefillTimeMsPerReq", "prefillPolicyType", "decodeTimeMsPerReq", "decodePolicyType",
    "maxBatchSize", "maxIterTimes", "maxPreemptCount", "supportSelectBatch",
    "maxQueueDelayMicroseconds", "maxFirstTokenWaitTime", "enableSplit", "splitType",
    "splitStartType", "splitChunkTokens", "splitStartBatchSize", "policyType", "enablePrefixCache",
    "bufferResponseEnabled", "prefillExpectedTime", "decodeExpectedTime",
}

# plugin_params keys pardec reads; MindIE's other plugins' keys (num_speculative_tokens: MTP) are
# known so that they reach the rules (which refuse the plugin) instead of a typo warning.
PLUGIN_PARAMS = {
    "plugin_type", "decoding_length", "dynamic_algo", "level", "window", "guess_set_size",
    "num_speculative_tokens",
}

# What pardec reads, per section; everything else MindIE defines is noted as unused.
USED = {
    "ServerConfig": {"inferMode"},
    "config.json": {"ServerConfig", "BackendConfig", "multiNodesInferEnabled", "ModelDeployConfig", "ScheduleConfig"},
    "BackendConfig": {"multiNodesInferEnabled", "ModelDeployConfig", "ScheduleConfig"},
    "ModelDeployConfig": MODEL_DEPLOY_CONFIG,
    "ModelConfig[0]": {"plugin_params", "modelName", "modelWeightPath", "worldSize", "npuMemSize", "backendType"},
    "ScheduleConfig": {"maxIterTimes", "templateType", "enableSplit"},
}

KNOWN = {
    # The full file, or a fragment that holds BackendConfig's keys at the top level.
    "config.json": TOP | BACKEND_CONFIG,
    "LogConfig": LOG_CONFIG,
    "ServerConfig": SERVER_CONFIG,
    "BackendConfig": BACKEND_CONFIG,
    "ModelDeployConfig": MODEL_DEPLOY_CONFIG,
    "ModelConfig[0]": MODEL_CONFIG,
    "ScheduleConfig": SCHEDULE_CONFIG,
    "plugin_params": PLUGIN_PARAMS,
}
